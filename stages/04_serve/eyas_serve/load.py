"""Replaying prompts against an OpenAI-compatible server at a fixed concurrency, streamed, timed per request.

Per request: time to first token (first streamed chunk that carries text or reasoning), end-to-end
latency, and output tokens from the server's own usage count (`stream_options.include_usage`; a chunk
may carry several tokens when a draft is accepted, so chunks are not counted). The inter-token latency
of a request is (latency - TTFT) / (output tokens - 1): the mean gap between its tokens after the first,
which is what speculation shortens (vLLM's benchmark calls it TPOT).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning", "reasoning_content")):
            return True
    return False


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    t0 = time.perf_counter()
    ttft, tokens, streamed = None, 0, False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                streamed, data = True, line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if ttft is None and _has_text(chunk):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = int(chunk["usage"].get("completion_tokens") or 0)
    except httpx.HTTPError as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    except (ValueError, TypeError, AttributeError) as e:  # a chunk that is not an OpenAI one: this request failed,
        # not the whole level (one such answer would otherwise end the bench in a traceback)
        return RequestResult(False, error=f"malformed stream chunk ({type(e).__name__}: {e})")
    if not streamed:  # a whole answer at once: no first-token time, no usage chunk, so nothing to measure
        return RequestResult(False, error="the answer came without a stream (no `data:` lines): the server "
                                          "ignored stream=true; measure a vLLM or SGLang server")
    latency = time.perf_counter() - t0
    return RequestResult(True, ttft if ttft is not None else latency, latency, tokens)


def request_body(model: str, messages: list[dict[str, str]], *, max_tokens: int, temperature: float) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}


async def replay(url: str, model: str, conversations: list[list[dict[str, str]]], *, concurrency: int,
                 max_tokens: int, temperature: float, timeout_s: float, label: str = "") -> dict[str, Any]:
    """Send every conversation once, `concurrency` in flight; the level's throughput and latency block."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    bar = tqdm(total=len(conversations), desc=label or f"c={concurrency}", unit="req", dynamic_ncols=True)
    done_tokens = 0
    t0 = time.perf_counter()

    async def bounded(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> RequestResult:
        nonlocal done_tokens
        async with sem:
            res = await one_request(client, url, request_body(model, messages, max_tokens=max_tokens,
                                                              temperature=temperature))
        done_tokens += res.output_tokens
        bar.update(1)
        bar.set_postfix_str(f"{done_tokens / max(1e-9, time.perf_counter() - t0):.0f} tok/s")
        return res

    try:
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            results = await asyncio.gather(*(bounded(client, m) for m in conversations))
    finally:
        bar.close()
    return level_stats(results, time.perf_counter() - t0)


def level_stats(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itl = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ms = lambda v: None if v is None else round(1000 * v, 3)  # noqa: E731
    return {
        "requests": len(ok), "errors": len(results) - len(ok), "output_tokens": tokens,
        "duration_s": round(duration_s, 3), "tokens_per_s": tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": {"p50": ms(percentile([r.ttft_s for r in ok], 50)), "p90": ms(percentile([r.ttft_s for r in ok], 90))},
        "itl_ms": {"p50": ms(percentile(itl, 50)), "p90": ms(percentile(itl, 90))},
        "first_errors": [r.error for r in results if not r.ok][:3],
    }


def served_model(client: httpx.Client, url: str) -> str:
    """The first model id in /v1/models (what requests must name)."""
    try:
        r = client.get(f"{url}/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ConnectionError(f"{url}/v1/models gives no model ({type(e).__name__}: {e}); is it an "
                              f"OpenAI-compatible server, and healthy?") from None
