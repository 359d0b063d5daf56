"""A vLLM-shaped OpenAI chat server for benchmarks and fault tests.

Raw `asyncio.Protocol` over HTTP/1.1 keep-alive: no framework, so one core serves several times what
any Python client can send, and a benchmark measures the client rather than the stub.

Routes: POST /v1/chat/completions (streamed as server-sent events when asked, as vLLM does), GET /health, GET /v1/models, GET /metrics (vLLM's, with no draft's
counters), and GET /stats (what was served, per outcome, as JSON; not counted itself). Chat answers come
from an `answer(payload) -> body` callable; the body is vLLM's `return_token_ids` shape (see
`vllm_body`), and like vLLM the ids are dropped unless the request asks for them. A payload without a
`messages` list gets vLLM's 400.

Faults, drawn once per chat request from a seeded RNG (rates are probabilities, summing to <= 1):
    500, 503       an OpenAI-style error body with that status
    429            the same, with a `Retry-After` header
    hang           never answers; the client's timeout must end it
    bad_json       200 with a truncated JSON body
    no_ids         200 with valid JSON but text only (no prompt_token_ids / token_ids)
    no_stream      200 with the whole answer as one JSON body, though the request asked for a stream
    drop           the connection is closed without a response

Use in-process (`start_stub`: its own event loop on a thread, for tests) or as a separate process
(`spawn_stub`, or `python -m eyas_testing.stub --port P ...`, for benchmarks: a stub sharing the
client's GIL would slow the client down).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Answer = Callable[[dict[str, Any]], dict[str, Any]]

FAULT_KINDS = ("500", "503", "429", "hang", "bad_json", "no_ids", "drop", "no_stream")
# Faults a client must retry; `no_ids` is a valid answer (the caller renders the ids itself).
RETRYABLE_FAULTS = ("500", "503", "429", "hang", "bad_json", "drop")

MODEL = "eyas-stub"
_ids = itertools.count()
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


def vllm_body(content: str, prompt_token_ids: list[int], token_ids: list[int], *,
              reasoning: str | None = None, finish_reason: str = "stop",
              model: str = MODEL) -> dict[str, Any]:
    """A chat completion as vLLM returns it for `"return_token_ids": true`."""
    n, m = len(prompt_token_ids), len(token_ids)
    return {
        "id": f"chatcmpl-{next(_ids)}", "object": "chat.completion", "model": model,
        "prompt_token_ids": prompt_token_ids,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": content, "reasoning": reasoning},
                     "finish_reason": finish_reason, "token_ids": token_ids}],
        "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m},
    }


def tiny_answer(payload: dict[str, Any]) -> dict[str, Any]:
    """The default answer: a fixed few-token body, so benchmarks measure HTTP, not JSON size."""
    return vllm_body("Hello!", [1, 2, 3, 4], [5, 6, 7], reasoning="hm")


@dataclass
class Faults:
    """Per-request fault probabilities, and how the faults look."""
    rates: dict[str, float] = field(default_factory=dict)   # kind (FAULT_KINDS) -> probability
    retry_after: str = "1"                                  # the 429's Retry-After value
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.rates) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        if sum(self.rates.values()) > 1 + 1e-9:
            raise ValueError(f"fault rates sum to {sum(self.rates.values())} > 1")

    @classmethod
    def spread(cls, total: float, kinds: tuple[str, ...] = RETRYABLE_FAULTS, **kw: Any) -> Faults:
        """`total` split evenly over `kinds`."""
        return cls(rates={k: total / len(kinds) for k in kinds}, **kw)


def _response(status: int, body: bytes, extra_headers: str = "", close: bool = False,
              content_type: str = "application/json") -> bytes:
    """A raw HTTP/1.1 response; `extra_headers` are complete `name: value\r\n` lines."""
    if close:
        extra_headers += "connection: close\r\n"
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n{extra_headers}\r\n")
    return head.encode("latin-1") + body


def sse_body(out: dict[str, Any], include_usage: bool) -> bytes:
    """A chat completion as vLLM streams it for `"stream": true`: the message as one delta, then (asked for
    with stream_options.include_usage) a chunk with the usage alone, then `data: [DONE]`."""
    choice, head = out["choices"][0], {"id": out["id"], "object": "chat.completion.chunk", "model": out["model"]}
    delta = {"role": "assistant", **{k: v for k, v in choice["message"].items() if k != "role" and v is not None}}
    chunks = [head | {"choices": [{"index": 0, "delta": delta, "finish_reason": choice["finish_reason"]}]}]
    if include_usage:
        chunks.append(head | {"choices": [], "usage": out["usage"]})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _error(status: int, message: str) -> bytes:
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}.get(status, "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class Stub:
    """The server state shared by its connections: answer, faults, RNG and counters."""

    def __init__(self, answer: Answer = tiny_answer, faults: Faults | None = None,
                 latency_s: float = 0.0, max_model_len: int | None = None) -> None:
        self.answer = answer
        self.max_model_len = max_model_len  # reported by /v1/models as vLLM does; None: not reported
        self.faults = faults or Faults()
        self.latency_s = latency_s
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(self.faults.seed)
        # Cumulative thresholds: one uniform draw picks the fault (or none) in O(#kinds).
        acc, self._thresholds = 0.0, []
        for kind in FAULT_KINDS:
            acc += self.faults.rates.get(kind, 0.0)
            self._thresholds.append((acc, kind))
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen in the running loop; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                reuse_address=True, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):   # hung requests would otherwise keep it open
                conn.transport.abort()
            await self._server.wait_closed()

    def draw_fault(self) -> str | None:
        r = self._rng.random()
        for threshold, kind in self._thresholds:
            if r < threshold:
                return kind
        return None

    def handle(self, method: str, path: str, body: bytes) -> tuple[str, bytes | None]:
        """(outcome, raw response); a None response means: say nothing (hang) or hang up (drop)."""
        if method == "GET" and path == "/health":
            return "health", _response(200, b"")
        if method == "GET" and path == "/v1/models":
            entry = {"id": MODEL, "object": "model", "owned_by": "eyas"}
            if self.max_model_len is not None:
                entry["max_model_len"] = self.max_model_len
            models = {"object": "list", "data": [entry]}
            return "models", _response(200, json.dumps(models).encode())
        if method == "GET" and path == "/stats":
            return "", _response(200, json.dumps(self.counts).encode())
        if method == "GET" and path == "/metrics":  # a vLLM serving no draft: no spec_decode counters
            return "", _response(200, f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'.encode())
        if method != "POST" or path != "/v1/chat/completions":
            return "404", _response(404, _error(404, f"no route {method} {path}"))
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
            return "400", _response(400, _error(400, "request body must be a JSON object with a 'messages' list"))
        fault = self.draw_fault()
        if fault in ("500", "503"):
            return fault, _response(int(fault), _error(int(fault), f"injected {fault}"))
        if fault == "429":
            return fault, _response(429, _error(429, "injected 429"), f"retry-after: {self.faults.retry_after}\r\n")
        if fault in ("hang", "drop"):
            return fault, None
        if fault == "bad_json":
            return fault, _response(200, b'{"id": "chatcmpl-x", "choices": [{"mess')
        try:
            out = self.answer(payload)
        except Exception as e:   # a broken answer function shows up as a 500 carrying its error
            return "answer_error", _response(500, _error(500, f"answer raised {e!r}"))
        if fault == "no_ids" or not payload.get("return_token_ids"):
            out = {k: v for k, v in out.items() if k != "prompt_token_ids"}
            out["choices"] = [{k: v for k, v in c.items() if k != "token_ids"} for c in out["choices"]]
        if payload.get("stream") and fault != "no_stream":
            usage = bool((payload.get("stream_options") or {}).get("include_usage"))
            return fault or "ok", _response(200, sse_body(out, usage), content_type="text/event-stream")
        return fault or "ok", _response(200, json.dumps(out).encode())


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: buffers bytes, answers each complete request in order."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.buf = bytearray()
        self.hung = False        # after a hang nothing more is read or written on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.stub._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.stub._connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.hung:
            return
        self.buf += data
        while not self.hung and not self.transport.is_closing():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            try:
                method, path, _ = lines[0].split(" ", 2)
            except ValueError:
                self.transport.write(_response(400, _error(400, "bad request line"), close=True))
                self.transport.close()
                return
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            size = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + size:
                return
            body = bytes(self.buf[end + 4:end + 4 + size])
            del self.buf[:end + 4 + size]
            self._answer(method, path.split("?", 1)[0], body, headers.get("connection", "").lower() == "close")

    def _answer(self, method: str, path: str, body: bytes, close: bool) -> None:
        outcome, raw = self.stub.handle(method, path, body)
        if outcome:
            self.stub.counts[outcome] += 1
        if outcome == "hang":
            self.hung = True
        elif raw is None:
            self.transport.close()   # drop: FIN with no response, as a crashed worker would leave it
        elif self.stub.latency_s > 0:
            # Equal delays fire in FIFO order, so pipelined answers keep their request order.
            asyncio.get_running_loop().call_later(self.stub.latency_s, self._send, raw, close)
        else:
            self._send(raw, close)

    def _send(self, raw: bytes, close: bool) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(raw)
        if close:
            self.transport.close()


class StubThread:
    """A stub serving from its own event loop on a daemon thread of this process."""

    def __init__(self, stub: Stub, host: str = "127.0.0.1", port: int = 0) -> None:
        self.stub = stub
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port = port
        self._thread = threading.Thread(target=self._run, args=(host,), daemon=True, name="eyas-stub")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"stub did not start on {host}:{port}") from self._error
        self.url = f"http://{host}:{self.port}"

    def _run(self, host: str) -> None:
        try:
            self.port = self._loop.run_until_complete(self.stub.start(host, self.port))
        except BaseException as e:   # handed to the starting thread, which raises it
            self._error = e
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self.stub.stop())
        self._loop.close()

    def counts(self) -> dict[str, int]:
        return dict(self.stub.counts)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def __enter__(self) -> StubThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_stub(port: int = 0, *, answer: Answer = tiny_answer, faults: Faults | None = None,
               latency_s: float = 0.0, max_model_len: int | None = None, host: str = "127.0.0.1") -> StubThread:
    """Serve in this process (a thread); `.port`, `.url`, `.counts()`, `.stop()`."""
    return StubThread(Stub(answer, faults, latency_s, max_model_len), host, port)


class StubProcess:
    """A stub in a child process (`python -m eyas_testing.stub`); counts come from its /stats route."""

    def __init__(self, args: list[str], host: str = "127.0.0.1") -> None:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen([sys.executable, "-m", "eyas_testing.stub", "--host", host, *args],
                                      stdout=subprocess.PIPE, env=env, text=True)
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line.startswith("listening "):
            self._proc.kill()
            raise RuntimeError(f"stub did not start (exit {self._proc.wait()}): {line!r}")
        self.url = line.split()[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def counts(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)

    def __enter__(self) -> StubProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_stub(port: int = 0, *, answer: str | None = None, faults: Faults | None = None,
               latency_s: float = 0.0, host: str = "127.0.0.1") -> StubProcess:
    """Serve from a child process; `answer` is an import path `module:function` (default: tiny)."""
    faults = faults or Faults()
    args = ["--port", str(port), "--seed", str(faults.seed), "--retry-after", faults.retry_after,
            "--latency", str(latency_s)]
    args += [a for kind, rate in faults.rates.items() for a in ("--fault", f"{kind}={rate}")]
    if answer:
        args += ["--answer", answer]
    return StubProcess(args, host)


def _load_answer(spec: str) -> Answer:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eyas_testing.stub", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    p.add_argument("--fail-rate", type=float, default=0.0,
                   help=f"total fault probability, spread evenly over {', '.join(RETRYABLE_FAULTS)}")
    p.add_argument("--fault", action="append", default=[], metavar="KIND=P",
                   help=f"probability of one fault kind ({', '.join(FAULT_KINDS)}); adds to --fail-rate")
    p.add_argument("--retry-after", default="1", help="Retry-After header value of injected 429s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    p.add_argument("--answer", help="module:function producing the chat body (default: a tiny fixed one)")
    a = p.parse_args(argv)
    rates = Faults.spread(a.fail_rate).rates if a.fail_rate else {}
    for item in a.fault:
        kind, _, rate = item.partition("=")
        rates[kind] = rates.get(kind, 0.0) + float(rate)
    stub = Stub(_load_answer(a.answer) if a.answer else tiny_answer,
                Faults(rates, a.retry_after, a.seed), a.latency)

    async def serve() -> None:
        port = await stub.start(a.host, a.port)
        print(f"listening http://{a.host}:{port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
