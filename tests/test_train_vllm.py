"""Stage 03 against real vLLM (CPU): a draft trained on the fixture target's own answers loads in vLLM,
speculates, and is accepted far more than an untrained one; `eyas-train eval` agrees with vLLM.

Slow by nature: a few hundred target answers, about ten minutes of CPU training, two vLLM servers.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from eyas_common.contract import Dataset
from eyas_common.fixture import write_prompts_jsonl
from eyas_common.servers import running_vllm
from eyas_common.prompts import load_prompts
from eyas_train.eval import evaluate
from eyas_train.train import run as train

from test_train_data import build_datasets

SPEC_TOKENS = 3
# The fixture recipe (stages/03_train/README.md): 20 epochs of 400 answers, 4 samples a step, 7 TTT steps.
RECIPE = dict(epochs=20, batch_size=4, lr=3e-3, ttt_steps=7, draft_vocab=1024, log_every=100, ckpt_every=500)


def _metric(text: str, name: str) -> dict[str, float]:
    """Prometheus samples of `name` summed per `position` label ('' when there is none)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            pos = re.search(r'position="(\d+)"', line)
            key = pos.group(1) if pos else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def vllm_acceptance(target: Path, draft: Path, prompts: Path, log: Path, *, max_tokens: int = 256,
                    concurrency: int = 8) -> dict[str, Any]:
    """Serve target + draft on vLLM (eagle3, greedy), answer every prompt, and read the spec-decode counters."""
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": SPEC_TOKENS}
    conversations = load_prompts(prompts)
    with running_vllm(target, log_path=log, timeout_s=900,
                      extra_args=["--speculative-config", json.dumps(spec)]) as server:
        def ask(messages: list[dict[str, Any]]) -> str:
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
                "model": str(target), "messages": messages, "temperature": 0.0, "max_tokens": max_tokens})
            r.raise_for_status()
            return r.json()["choices"][0]["finish_reason"]

        with ThreadPoolExecutor(concurrency) as pool:
            finish = list(pool.map(ask, conversations))
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    drafts = _metric(text, "vllm:spec_decode_num_drafts_total")[""]
    accepted = _metric(text, "vllm:spec_decode_num_accepted_tokens_total")[""]
    per_pos = _metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    return {"drafts": drafts, "accepted": accepted, "acceptance_length": 1 + accepted / drafts,
            "per_position": [per_pos.get(str(i), 0.0) / drafts for i in range(SPEC_TOKENS)],
            "finish_reasons": {f: finish.count(f) for f in set(finish)}}


@pytest.mark.vllm
def test_trained_draft_speculates_in_vllm(fixture_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_train")
    hidden = build_datasets(root, fixture_target, 400, seed=0)
    prompts = write_prompts_jsonl(root / "heldout.jsonl", 40, seed=11)  # held-out problems, not trained on

    t0 = time.monotonic()
    draft = train(hidden=hidden.ref, model=fixture_target, name="fixture_trained", data_root=root, **RECIPE)
    train_s = time.monotonic() - t0
    untrained = train(hidden=hidden.ref, model=fixture_target, name="fixture_untrained", data_root=root,
                      **{**RECIPE, "epochs": 0})

    trained_vllm = vllm_acceptance(fixture_target, draft, prompts, root / "vllm_trained.log")
    offline = evaluate(draft="drafts/fixture_trained", model=fixture_target, prompts=prompts,
                       spec_tokens=SPEC_TOKENS, data_root=root)
    few = write_prompts_jsonl(root / "heldout10.jsonl", 10, seed=11)
    untrained_vllm = vllm_acceptance(fixture_target, untrained, few, root / "vllm_untrained.log")
    report = {"train_s": round(train_s, 1), "vllm_trained": trained_vllm, "eval_trained": offline,
              "vllm_untrained": untrained_vllm,
              "final": Dataset.parse("fixture_trained", "drafts", root).read_manifest()["stats"]["final"]}
    print(json.dumps(report, indent=2))

    assert trained_vllm["finish_reasons"] == {"stop": 40}
    assert trained_vllm["acceptance_length"] >= 3.3, report
    assert untrained_vllm["acceptance_length"] < 1.5, report
    assert abs(offline["acceptance_length"] - trained_vllm["acceptance_length"]) <= 0.15, report
