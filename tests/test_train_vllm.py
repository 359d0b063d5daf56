"""Stage 03 against real vLLM (CPU): the session's draft, trained on the fixture target's own answers, trains
in time and to a high accuracy, and an untrained draft (`--epochs 0`) loads in vLLM but is almost never
accepted. The trained draft is served and measured through stage 04 (`tests/test_serve_vllm.py`), which
also checks it against `eyas-train eval`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from eyas_common.contract import Dataset
from eyas_common.fixture import write_prompts_jsonl
from eyas_common.prompts import load_prompts
from eyas_common.servers import running_vllm
from eyas_serve.engines import speculative_config
from eyas_serve.metrics import parse_vllm_metrics
from eyas_train.train import run as train

from conftest import RECIPE

SPEC_TOKENS = 3


def vllm_acceptance(target: Path, draft: Path, prompts: Path, log: Path, *, max_tokens: int = 256,
                    concurrency: int = 8) -> dict[str, Any]:
    """Serve target + draft on vLLM (eagle3, greedy), answer every prompt, and read the spec-decode counters."""
    with running_vllm(target, log_path=log, timeout_s=900,
                      extra_args=["--speculative-config", json.dumps(speculative_config(draft, SPEC_TOKENS))]
                      ) as server:
        def ask(messages: list[dict[str, Any]]) -> str:
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
                "model": str(target), "messages": messages, "temperature": 0.0, "max_tokens": max_tokens})
            r.raise_for_status()
            return r.json()["choices"][0]["finish_reason"]

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(ask, load_prompts(prompts)))
        return parse_vllm_metrics(httpx.get(f"{server.url}/metrics", timeout=30).text).summary()


@pytest.mark.vllm
def test_trained_draft_learns_and_untrained_is_rejected(trained_draft, fixture_target):
    root = trained_draft.root
    final = Dataset.parse("fixture_trained", "drafts", root).read_manifest()["stats"]["final"]
    untrained = train(hidden="hidden/fixture_400_0", model=fixture_target, name="fixture_untrained", data_root=root,
                      **{**RECIPE, "epochs": 0})
    few = write_prompts_jsonl(root / "heldout10.jsonl", 10, seed=11)
    untrained_vllm = vllm_acceptance(fixture_target, untrained, few, root / "vllm_untrained.log")
    report = {"train_s": round(trained_draft.train_s, 1), "final": final, "vllm_untrained": untrained_vllm}
    print(json.dumps(report, indent=2))

    assert final["step_acc"][0] > 0.7, report
    assert untrained_vllm["acceptance_length"] < 1.5, report
