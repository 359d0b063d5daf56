"""A draft's acceptance as a real vLLM server counts it, in one call: serve target + draft (eagle3), answer
every prompt greedily, read the spec-decode counters (acceptance length = 1 + accepted / drafts).

For tests and bench/quality.py, which need the number and nothing else; users run `eyas-serve bench`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from eyas_common.prompts import load_prompts
from eyas_serve.metrics import parse_vllm_metrics
from eyas_testing.servers import running_vllm


def vllm_acceptance(target: Path, draft: Path, prompts: Path, log: Path, *, spec_tokens: int = 3,
                    max_tokens: int = 256, concurrency: int = 8, timeout_s: float = 900,
                    extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """The server's spec counters after answering `prompts`, plus how the answers finished.

    `extra_args` go to vLLM last (e.g. `--enforce-eager`, which spares a deep target minutes of graph capture
    at start-up on CPU).
    """
    with running_vllm(target, log_path=log, timeout_s=timeout_s, draft=draft, spec_tokens=spec_tokens,
                      extra_args=extra_args) as server:
        def ask(messages: list[dict[str, Any]]) -> str:
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
                "model": str(target), "messages": messages, "temperature": 0.0, "max_tokens": max_tokens})
            r.raise_for_status()
            return r.json()["choices"][0]["finish_reason"]

        with ThreadPoolExecutor(concurrency) as pool:
            finish = list(pool.map(ask, load_prompts(prompts)))
        counters = parse_vllm_metrics(httpx.get(f"{server.url}/metrics", timeout=30).text)
    if counters is None:
        raise RuntimeError(f"{server.url} exposes no spec-decode counters: was the draft loaded? see {log}")
    return counters.summary() | {"finish_reasons": {f: finish.count(f) for f in set(finish)}}
