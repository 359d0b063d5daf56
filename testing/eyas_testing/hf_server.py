"""An OpenAI-shaped chat server over transformers generation, for targets vLLM cannot load here.

vLLM 0.32 maps `KimiK25ForConditionalGeneration` to its own implementation (not the model folder's
remote code), which wants K2.5's real vision tower, processor and weights; and its CPU MLA kernels
take only K2.5's full MLA widths. The tiny Kimi-K2.5-shaped fixture has neither, so this server
answers for it, in vLLM's shape: `"return_token_ids": true` gives top-level `prompt_token_ids` and
`choices[0].token_ids` (the end-of-turn token included when the answer stopped), the message has
`reasoning` (the text before `</think>`, as vLLM's kimi_k2 parser gives it) and `content`.
Requests run one at a time (a tiny target on CPU); sampling honours temperature, top_p and seed.

    python -m eyas_testing.hf_server --model DIR [--trust-remote-code] [--port 8000]
Routes: POST /v1/chat/completions, GET /v1/models, GET /health.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from eyas_common.chat import ChatTokens, load_tokenizer, render_prompt


class Generator:
    """The target and its tokenizer; `answer(payload)` is one chat completion body."""

    def __init__(self, model: Path, *, trust_remote_code: bool, dtype: str = "float32", name: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.name = name or str(model)
        self.tokenizer = load_tokenizer(model, trust_remote_code)
        self.tokens = ChatTokens.of(self.tokenizer)
        self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype),
                                                          trust_remote_code=trust_remote_code).eval()
        self.lock = threading.Lock()
        self.served = 0

    def answer(self, payload: dict[str, Any]) -> dict[str, Any]:
        kwargs = payload.get("chat_template_kwargs") or {}
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))  # None: the template's default
        prompt = render_prompt(self.tokenizer, payload["messages"], thinking)
        ids, finish = self._generate(prompt, payload)
        reasoning, content = self._split(ids, prompt)
        body = {
            "id": f"chatcmpl-{self.served}", "object": "chat.completion", "created": int(time.time()),
            "model": self.name,
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content, "reasoning": reasoning}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)},
        }
        if payload.get("return_token_ids"):
            body["prompt_token_ids"] = prompt
            body["choices"][0]["token_ids"] = ids
        return body

    def _generate(self, prompt: list[int], payload: dict[str, Any]) -> tuple[list[int], str]:
        torch = self.torch
        temperature = float(payload.get("temperature", 1.0))
        max_tokens = int(payload.get("max_tokens") or payload.get("max_completion_tokens") or 256)
        sample = temperature > 0
        with self.lock, torch.no_grad():
            if payload.get("seed") is not None:
                torch.manual_seed(int(payload["seed"]))
            out = self.model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=sample, temperature=temperature if sample else None,
                top_p=float(payload.get("top_p", 1.0)) if sample else None, top_k=None,
                eos_token_id=self.tokens.end_of_turn, pad_token_id=self.tokenizer.pad_token_id)
            self.served += 1
        ids = out[0, len(prompt):].tolist()
        return ids, "stop" if ids and ids[-1] == self.tokens.end_of_turn else "length"

    def _split(self, ids: list[int], prompt: list[int]) -> tuple[str | None, str]:
        """(reasoning, content) as vLLM's kimi_k2 reasoning parser splits them."""
        body = ids[:-1] if ids and ids[-1] == self.tokens.end_of_turn else ids
        opened = prompt[-1:] == [self.tokens.think_open] or body[:1] == [self.tokens.think_open]
        if body[:1] == [self.tokens.think_open]:
            body = body[1:]
        decode = lambda x: self.tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
        if not opened:
            return None, decode(body)
        if self.tokens.think_close not in body:
            return decode(body).rstrip(), ""  # cut off inside the reasoning
        cut = body.index(self.tokens.think_close)
        return decode(body[:cut]).rstrip() or None, decode(body[cut + 1:])


def handler_for(gen: Generator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": gen.name, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            try:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not isinstance(payload.get("messages"), list):
                    raise ValueError("the request has no `messages` list")
            except ValueError as e:
                return self._send(400, {"error": {"message": str(e), "type": "BadRequestError"}})
            try:
                self._send(200, gen.answer(payload))
            except Exception as e:  # noqa: BLE001 - reported to the client as vLLM does
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "InternalServerError"}})

        def log_message(self, fmt: str, *args: Any) -> None:
            print(f"[hf-server] {self.address_string()} {fmt % args}", file=sys.stderr, flush=True)

    return Handler


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eyas_testing.hf_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="local model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start); default 8000")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="default float32")
    p.add_argument("--served-model-name", default=None, help="default: the model path")
    p.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model (opt-in)")
    a = p.parse_args(argv)
    gen = Generator(a.model, trust_remote_code=a.trust_remote_code, dtype=a.dtype, name=a.served_model_name)
    server = ThreadingHTTPServer((a.host, a.port), handler_for(gen))
    print(f"listening http://{a.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
