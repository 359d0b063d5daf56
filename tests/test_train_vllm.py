"""Stage 03 against real vLLM (CPU): a draft trained on the fixture target's own answers loads in vLLM,
speculates, and is accepted far more than an untrained one; `eyas-train eval` agrees with vLLM.

Slow by nature: a few hundred target answers, five to ten minutes of CPU training, two vLLM servers.
"""

from __future__ import annotations

import json
import time

import pytest

from eyas_common.contract import Dataset
from eyas_common.fixture import write_prompts_jsonl
from eyas_common.spec_metrics import vllm_acceptance
from eyas_train.eval import evaluate
from eyas_train.train import run as train

from test_train_data import build_datasets

SPEC_TOKENS = 3
# The default recipe (resolved from the data: stages/03_train/README.md); only the output is quieter.
RECIPE = dict(log_every=100, ckpt_every=500)


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
    stats = Dataset.parse("fixture_trained", "drafts", root).read_manifest()["stats"]
    report = {"train_s": round(train_s, 1), "vllm_trained": trained_vllm, "eval_trained": offline,
              "vllm_untrained": untrained_vllm, "final": stats["final"], "validation": stats["val"],
              "predicted": stats["predicted_acceptance"][str(SPEC_TOKENS)]}
    print(json.dumps(report, indent=2))

    assert trained_vllm["finish_reasons"] == {"stop": 40}
    assert trained_vllm["acceptance_length"] >= 3.3, report
    assert untrained_vllm["acceptance_length"] < 1.5, report
    assert abs(offline["acceptance_length"] - trained_vllm["acceptance_length"]) <= 0.15, report
    # the acceptance length `eyas-train run` predicts from its validation slice is vLLM's, within 0.2
    assert abs(report["predicted"] - trained_vllm["acceptance_length"]) <= 0.2, report
