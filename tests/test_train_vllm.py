"""Stage 03 against real vLLM (CPU): the session's draft, trained on the fixture target's own answers, trains
in time and to a high accuracy, and an untrained draft (`--epochs 0`) loads in vLLM but is almost never
accepted. The trained draft is served and measured through stage 04 (`tests/test_serve_vllm.py`), which
also checks it against `eyas-train eval`.
"""

from __future__ import annotations

import json

import pytest

from eyas_common.contract import Dataset
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.acceptance import vllm_acceptance
from eyas_train.train import run as train


@pytest.mark.vllm
def test_trained_draft_learns_and_untrained_is_rejected(trained_draft, fixture_target):
    root = trained_draft.root
    final = Dataset.parse("fixture_trained", "drafts", root).read_manifest()["stats"]["final"]
    untrained = train(hidden="hidden/fixture_400_0", model=fixture_target, name="fixture_untrained", data_root=root,
                      log_every=100, epochs=0)
    few = write_prompts_jsonl(root / "heldout10.jsonl", 10, seed=11)
    untrained_vllm = vllm_acceptance(fixture_target, untrained, few, root / "vllm_untrained.log")
    report = {"train_s": round(trained_draft.train_s, 1), "final": final, "vllm_untrained": untrained_vllm}
    print(json.dumps(report, indent=2))

    assert final["step_acc"][0] > 0.7, report
    assert untrained_vllm["acceptance_length"] < 1.5, report
