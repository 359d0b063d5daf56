"""Acceptance of an EAGLE-3 draft as a real vLLM server counts it: serve target + draft, answer prompts
greedily, read the spec-decode counters from /metrics (acceptance length = 1 + accepted / drafts)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from eyas_common.prompts import load_prompts
from eyas_common.servers import running_vllm


def prometheus_sums(text: str, name: str) -> dict[str, float]:
    """Prometheus samples of `name` summed per `position` label ('' when there is none)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            pos = re.search(r'position="(\d+)"', line)
            key = pos.group(1) if pos else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def vllm_acceptance(target: Path, draft: Path, prompts: Path, log: Path, *, spec_tokens: int = 3,
                    max_tokens: int = 256, concurrency: int = 8, timeout_s: float = 900) -> dict[str, Any]:
    """Serve target + draft on vLLM (eagle3, greedy), answer every prompt, and read the spec-decode counters."""
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": spec_tokens}
    conversations = load_prompts(prompts)
    with running_vllm(target, log_path=log, timeout_s=timeout_s,
                      extra_args=["--speculative-config", json.dumps(spec)]) as server:
        def ask(messages: list[dict[str, Any]]) -> str:
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
                "model": str(target), "messages": messages, "temperature": 0.0, "max_tokens": max_tokens})
            r.raise_for_status()
            return r.json()["choices"][0]["finish_reason"]

        with ThreadPoolExecutor(concurrency) as pool:
            finish = list(pool.map(ask, conversations))
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    drafts = prometheus_sums(text, "vllm:spec_decode_num_drafts_total")[""]
    accepted = prometheus_sums(text, "vllm:spec_decode_num_accepted_tokens_total")[""]
    per_pos = prometheus_sums(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    return {"drafts": drafts, "accepted": accepted, "acceptance_length": 1 + accepted / drafts,
            "per_position": [per_pos.get(str(i), 0.0) / drafts for i in range(spec_tokens)],
            "finish_reasons": {f: finish.count(f) for f in set(finish)}}
