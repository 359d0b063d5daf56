"""Synth client speed: eyas's ChatPool against a thread-pool `openai` client, side by side.

Both send the same chat requests to one zero-latency vLLM-shaped stub running in a separate process,
with the same number in flight; wall time includes building the client. `--plain` adds one plain
httpx AsyncClient (the naive use of httpx) for reference.

    PYTHONPATH=stages/01_synth:common:testing .venv/bin/python bench/synth_client.py [--requests 5000] [--concurrency 128]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from eyas_synth.client import ChatPool
from eyas_testing.stub import spawn_stub

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Explain speculative decoding in two sentences."}]
PAYLOAD = {"model": "eyas-stub", "messages": MESSAGES, "max_tokens": 256, "temperature": 0.6,
           "top_p": 0.95, "return_token_ids": True}


async def _workers(n: int, concurrency: int, send) -> None:
    """`concurrency` tasks draining one shared count of `n` requests, as the synth run loop does."""
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            await send()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def bench_eyas(url: str, n: int, concurrency: int) -> float:
    async def main() -> None:
        async with ChatPool([url], concurrency=concurrency) as pool:
            async def send() -> None:
                body, _ = await pool.chat(PAYLOAD)
                assert body["choices"][0]["token_ids"]
            await _workers(n, concurrency, send)

    t = time.perf_counter()
    asyncio.run(main())
    return n / (time.perf_counter() - t)


def bench_plain_httpx(url: str, n: int, concurrency: int) -> float:
    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=600) as client:
            async def send() -> None:
                r = await client.post(f"{url}/v1/chat/completions", json=PAYLOAD)
                assert r.json()["choices"][0]["token_ids"]
            await _workers(n, concurrency, send)

    t = time.perf_counter()
    asyncio.run(main())
    return n / (time.perf_counter() - t)


def bench_openai_threads(url: str, n: int, concurrency: int) -> float:
    t = time.perf_counter()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY")
    todo = iter(range(n))
    lock = threading.Lock()   # a bare iterator is not safe to share between threads

    def worker() -> None:
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            out = client.chat.completions.create(
                model=PAYLOAD["model"], messages=MESSAGES, max_tokens=256, temperature=0.6, top_p=0.95,
                extra_body={"return_token_ids": True})
            assert out.choices[0].token_ids  # type: ignore[attr-defined]

    with ThreadPoolExecutor(concurrency) as threads:
        for f in [threads.submit(worker) for _ in range(concurrency)]:
            f.result()
    client.close()
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--plain", action="store_true", help="also measure one plain httpx AsyncClient")
    a = p.parse_args()
    with spawn_stub() as stub:
        print(f"{a.requests} requests, {a.concurrency} in flight, stub at {stub.url} (separate process)")
        eyas = bench_eyas(stub.url, a.requests, a.concurrency)
        print(f"eyas ChatPool: {eyas:.0f} req/s wall", flush=True)
        if a.plain:
            print(f"plain httpx AsyncClient: {bench_plain_httpx(stub.url, a.requests, a.concurrency):.0f} req/s wall",
                  flush=True)
        ref = bench_openai_threads(stub.url, a.requests, a.concurrency)
        print(f"openai threads: {ref:.0f} req/s wall")
        print(f"ratio: {eyas / ref:.1f}x")
        served = stub.counts().get("ok", 0)
        expected = a.requests * (3 if a.plain else 2)
        if served != expected:
            raise SystemExit(f"stub served {served} answers, expected {expected}")


if __name__ == "__main__":
    main()
