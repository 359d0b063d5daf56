"""The async HTTP layer of synth: chat requests spread over OpenAI-compatible servers, with retries.

Why lanes. httpcore's connection pool re-plans every request against every pooled connection, at both
the start and the end of the request (`_assign_requests_to_connections`): for each idle connection it
re-counts the idle list (O(C^2) Python calls for C connections) and polls its socket for expiry (O(C)
`poll` + `getpeername` syscalls). One AsyncClient holding 128 connections thus spends ~6,000 `is_idle`
calls and ~100 syscalls per request, and falls from ~1,400 req/s at one request in flight to ~270 at
128 (cProfile: 75% of the time in that function). So each server here gets a set of *lanes*: an
AsyncClient with a single connection that carries one request at a time, taken from and returned to a
free list in O(1). The pool scan is then constant, and the remaining cost is httpx's own per-request
work (request build, h11, anyio), which keeps one core above 1,500 req/s.

Start-up is cheap because lanes share one SSL context: httpx builds a fresh one per client by default
(certifi load, ~14 ms, i.e. ~1.8 s for 128 clients); shared, a client costs ~15 us, so lanes are made
lazily as concurrency first reaches them.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

STATS = ("requests", "retries", "http_429", "http_5xx", "http_4xx", "timeouts", "connect_errors",
         "bad_json", "aborted", "failed")

# One encoder for every body: compact and UTF-8 (not \\u escapes), which is what the server parses
# fastest and what keeps long non-English prompts small.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

# Below uvicorn's default keep-alive timeout (5 s, which vLLM keeps): an idle connection is dropped
# here before the server can close it under a request that is just being sent.
_KEEPALIVE_S = 4.0


def _capped_doubling(first: float, n: int, cap: float) -> float:
    """first * 2**(n-1), at most cap (the exponent is clamped so huge n cannot overflow a float)."""
    return min(cap, first * 2.0 ** min(n - 1, 60))


@dataclass(frozen=True)   # frozen: one instance is the shared default of every ChatPool
class RetryPolicy:
    max_attempts: int = 8        # total tries per request
    backoff_s: float = 0.5       # first backoff; doubles each try, full jitter
    max_backoff_s: float = 30.0

    def delay(self, failures: int) -> float:
        """Full jitter (uniform in [0, cap]): concurrent retries of one outage spread out instead of
        returning together, at half the mean wait of a fixed exponential backoff."""
        return random.uniform(0.0, _capped_doubling(self.backoff_s, failures, self.max_backoff_s))


Failure = tuple[str, str]   # (stats counter such as http_5xx or connect_errors, the error as a user reads it)


class RequestFailed(Exception):
    """A request that failed for good; `kind` is its last failure's stats counter (http_4xx, timeouts, ...).
    `first` is the first failed attempt, on any server, since the pool's last success: when a server
    dies, that is its own error (an HTTP 500 and its message), before the refused connections."""

    def __init__(self, attempts: int, last_error: str, kind: str = "failed", first: Failure | None = None) -> None:
        super().__init__(f"request failed after {attempts} attempt(s): {last_error}")
        self.attempts = attempts
        self.last_error = last_error
        self.kind = kind
        self.first = first or (kind, last_error)


class ServersDown(Exception):
    """Every server has failed every attempt for `breaker_s` seconds: the whole run should stop."""

    def __init__(self, seconds: float, last: Failure, first: Failure) -> None:
        super().__init__(f"every server failed for {seconds:.0f} s; last error: {last[1]}")
        self.seconds, self.last, self.first = seconds, last, first


class _Failure(Exception):
    """One failed attempt: the stats counter it bumps, and whether and when to try again."""

    def __init__(self, kind: str, message: str, retryable: bool = True, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.kind, self.retryable, self.retry_after = kind, retryable, retry_after


class _Server:
    """One base URL: its free lanes, requests in flight, and recent health."""

    def __init__(self, base: str) -> None:
        self.base = base
        # Parsed once: httpx re-parses a str URL on every request (~13 us of ~450 us per request).
        self.chat_url = httpx.URL(f"{base}/v1/chat/completions")
        self.free: list[httpx.AsyncClient] = []   # LIFO: the most recently used lane's socket is warm
        self.lanes: list[httpx.AsyncClient] = []
        self.in_flight = 0
        self.failures = 0          # consecutive failed attempts; a success resets it
        self.avoid_until = 0.0     # loop time before which other servers are preferred


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _retry_after(response: httpx.Response) -> float:
    """Seconds from a Retry-After header (delta-seconds or HTTP date); 0 when absent or unreadable."""
    value = response.headers.get("retry-after")
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return 0.0


class ChatPool:
    """POSTs chat completions to one or more servers; see `chat`.

    `stats` counts chat calls (`requests`), extra attempts (`retries`; attempts = requests + retries),
    failed attempts by cause (`http_429`, `http_5xx`, `http_4xx`, `timeouts`, `connect_errors` for
    refused / reset / dropped connections, `bad_json` for 200s without a usable body) and chat calls
    that raised (`failed`).
    """

    def __init__(self, servers: list[str], *, concurrency: int = 128, timeout_s: float = 600.0,
                 retry: RetryPolicy = RetryPolicy(), api_key: str | None = None,
                 breaker_s: float | None = None) -> None:
        if not servers:
            raise ValueError("ChatPool needs at least one server URL")
        if retry.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {retry.max_attempts}")
        self._servers = [_Server(_base_url(s)) for s in servers]
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retry = retry
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        self._ssl: Any = None
        self._slots: asyncio.Semaphore | None = None
        # Circuit breaker: when no attempt on any server has succeeded for breaker_s seconds since the
        # first failure, every request raises ServersDown instead of retrying (None: never).
        self.breaker_s = breaker_s
        self._failing_since: float | None = None
        self._outage_first: Failure | None = None   # first failed attempt since the last success
        self._last_heard = 0.0   # loop time of the last response or failed attempt (or of the start)

    async def __aenter__(self) -> ChatPool:
        self._ssl = httpx.create_ssl_context()
        # The caller bounds its requests in flight; this is the backstop for one that does not, so that
        # lanes (sockets) per server never exceed `concurrency`. Uncontended, it costs no await.
        self._slots = asyncio.Semaphore(self.concurrency)
        self._last_heard = asyncio.get_running_loop().time()
        return self

    async def __aexit__(self, *exc: object) -> None:
        lanes = [lane for s in self._servers for lane in s.lanes]
        await asyncio.gather(*(lane.aclose() for lane in lanes), return_exceptions=True)
        for s in self._servers:
            s.lanes.clear()
            s.free.clear()

    def _new_lane(self) -> httpx.AsyncClient:
        one = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=_KEEPALIVE_S)
        # trust_env=False: no proxy / netrc / SSL env lookups; these servers are addressed directly.
        # httpx's timeout applies per phase (connect, write, each read); a non-streamed completion sends
        # nothing until it is done, so the first read's timeout bounds the whole request.
        return httpx.AsyncClient(limits=one, timeout=self.timeout_s, headers=self._headers,
                                 verify=self._ssl, trust_env=False)

    def _pick(self, avoid: _Server | None) -> _Server:
        """Least in flight among servers not recently failing; never the one that just failed this
        request while there is another. A failing server is probed again once its avoidance ends."""
        now = asyncio.get_running_loop().time()
        candidates = [s for s in self._servers if s is not avoid] or self._servers
        return min(candidates, key=lambda s: (s.avoid_until > now, s.in_flight))

    async def chat(self, payload: dict) -> tuple[dict, str]:
        """POST {server}/v1/chat/completions; returns (parsed JSON body, server url). Retries with
        exponential backoff + full jitter on 429, 5xx, timeouts (per-request timeout_s), connection errors,
        and on 200 responses whose body is not JSON or lacks `choices[0].message`; honours Retry-After on 429/503.
        Raises RequestFailed after max_attempts. Non-retryable 4xx (400, 404, ...) raise RequestFailed
        at once with the server's error text."""
        if self._slots is None:
            raise RuntimeError("use ChatPool inside `async with`")
        body = _encode(payload).encode()
        self.stats["requests"] += 1
        server: _Server | None = None
        for attempt in range(1, self.retry.max_attempts + 1):
            server = self._pick(avoid=server)
            try:
                async with self._slots:
                    data = await self._send(server, body)
            except _Failure as f:
                self.stats[f.kind] += 1
                error = f"{f} ({server.base})"
                self._outage_first = self._outage_first or (f.kind, error)
                down_for = self._down_for() if f.retryable and f.kind != "http_429" else 0.0  # 4xx, 429: it is up
                if self.breaker_s is not None and down_for >= self.breaker_s:
                    self.stats["failed"] += 1
                    raise ServersDown(down_for, (f.kind, error), self._outage_first) from None
                if not f.retryable or attempt == self.retry.max_attempts:
                    self.stats["failed"] += 1
                    raise RequestFailed(attempt, error, f.kind, self._outage_first) from None
                self._failed(server)
                self.stats["retries"] += 1
                cap = self.retry.max_backoff_s
                wait = max(self.retry.delay(attempt), min(f.retry_after, cap))
                if self.breaker_s is not None:  # wake up in time to trip the breaker, not a backoff later
                    wait = min(wait, max(0.05, self.breaker_s - down_for))
                await asyncio.sleep(wait)
                continue
            server.failures = 0
            self._failing_since = self._outage_first = None
            return data, server.base
        raise AssertionError("unreachable: the last attempt returns or raises")

    def quiet(self) -> tuple[float, int]:
        """(seconds since the last response or failed attempt, requests in flight now)."""
        return asyncio.get_running_loop().time() - self._last_heard, sum(s.in_flight for s in self._servers)

    async def probe(self, timeout_s: float) -> list[str]:
        """Whether each server still answers GET /v1/models within timeout_s, in words: one busy with long
        completions does, one that hangs does not."""
        async with httpx.AsyncClient(timeout=timeout_s, headers=self._headers, verify=self._ssl,
                                     trust_env=False) as http:
            async def one(s: _Server) -> str:
                try:
                    r = await http.get(f"{s.base}/v1/models")
                except httpx.HTTPError as e:
                    return (f"{s.base} does not answer GET /v1/models either ({type(e).__name__}): it hangs or "
                            f"is overloaded, check its log")
                if r.status_code != 200:
                    return f"{s.base} answers GET /v1/models with HTTP {r.status_code}: check its log"
                return f"{s.base} answers GET /v1/models, so it is up and working on {s.in_flight}"
            return list(await asyncio.gather(*(one(s) for s in self._servers)))

    def _down_for(self) -> float:
        """Seconds since the first failed attempt with no success after it (0 while things work)."""
        now = asyncio.get_running_loop().time()
        if self._failing_since is None:
            self._failing_since = now
        return now - self._failing_since

    def _failed(self, server: _Server) -> None:
        server.failures += 1
        # Other servers take new requests for one backoff step per consecutive failure (capped), so a
        # dead server gets a probe every max_backoff_s rather than its share of all traffic.
        step = _capped_doubling(self.retry.backoff_s, server.failures, self.retry.max_backoff_s)
        server.avoid_until = asyncio.get_running_loop().time() + step

    async def _send(self, server: _Server, body: bytes) -> dict:
        lane = server.free.pop() if server.free else None
        if lane is None:
            lane = self._new_lane()
            server.lanes.append(lane)
        server.in_flight += 1
        try:
            r = await lane.post(server.chat_url, content=body)
        except httpx.TimeoutException as e:
            raise _Failure("timeouts", f"no answer within {self.timeout_s:g} s ({type(e).__name__})") from None
        except httpx.DecodingError as e:
            raise _Failure("bad_json", f"undecodable body: {e}") from None
        except httpx.RequestError as e:
            raise _Failure("connect_errors", f"{type(e).__name__}: {e}") from None
        finally:
            server.in_flight -= 1
            server.free.append(lane)
            self._last_heard = asyncio.get_running_loop().time()
        status = r.status_code
        if status == 200:
            try:
                data = json.loads(r.content)
                ok = isinstance(data["choices"][0]["message"], dict)
            except (ValueError, LookupError, TypeError):
                ok = False
            if not ok:
                raise _Failure("bad_json", f"HTTP 200 without a chat completion: {r.content[:200]!r}")
            # vLLM ends a request it dropped (preempted, shutting down) with finish_reason "abort": no answer of
            # the target's, so it is asked again, not kept or rejected as one
            if data["choices"][0].get("finish_reason") == "abort":
                raise _Failure("aborted", "HTTP 200 with finish_reason 'abort': the server dropped the request")
            return data
        text = f"HTTP {status}: {r.text[:500]}"
        if status == 429:
            raise _Failure("http_429", text, retry_after=_retry_after(r))
        if status >= 500:
            raise _Failure("http_5xx", text, retry_after=_retry_after(r) if status == 503 else 0.0)
        raise _Failure("http_4xx", text, retryable=False)


async def report_silence(pool: ChatPool, say: Callable[[str], None], first_s: float) -> None:
    """Runs beside the requests until cancelled: when nothing has been heard for first_s seconds (then
    2x, 4x, ... of it) with requests in flight, `say`s how long, and whether each server still answers
    /v1/models. A frozen progress bar cannot tell a server busy with long completions from one that
    hangs, and each request may wait the whole --timeout before it fails."""
    next_s, tick = first_s, min(5.0, max(first_s / 4, 0.05))   # a few checks per silence, not a busy loop
    while True:
        await asyncio.sleep(tick)
        quiet, in_flight = pool.quiet()
        if quiet < first_s:
            next_s = first_s
        elif quiet >= next_s and in_flight:
            servers = "; ".join(await pool.probe(timeout_s=min(10.0, first_s)))
            say(f"no answer for {quiet:.0f} s with {in_flight} requests in flight (each waits up to "
                f"--timeout {pool.timeout_s:g} s): {servers}")
            next_s *= 2
