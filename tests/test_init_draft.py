"""`eyas-train run --init-draft`: reading a draft back in the eyas, SpecForge and vLLM/speculators layouts
(export -> init -> export is identical), refusals, and a finetune that starts at the draft's accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas_common.contract import DatasetError
from eyas_train.export import write_draft
from eyas_train.init_draft import init_vocab, read_init_draft
from eyas_train.train import run as train_run

from eyas_testing.datasets import build_datasets

OPTS = {"draft_vocab": 512, "ttt_steps": 3, "batch_size": 4, "lr": 3e-3, "log_every": 1}


@pytest.fixture(scope="module")
def trained(fixture_target, tmp_path_factory):
    """drafts/base: a draft trained for 4 epochs on 24 fixture samples, and its data."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("init_draft")
    hidden = build_datasets(root, fixture_target, 24, seed=5, per_shard=10)
    train_run(hidden=hidden.ref, model=fixture_target, name="base", data_root=root, epochs=4, **OPTS)
    return root, hidden


def log(root: Path, name: str) -> list[dict]:
    """The training records of a draft's log (validation records left out)."""
    records = (json.loads(line) for line in (root / "drafts" / name / "train_log.jsonl").read_text().splitlines())
    return [r for r in records if "step_acc" in r]


def as_speculators(src: Path, dst: Path, target: Path) -> Path:
    """The same draft as the vLLM/speculators format writes it: `layers.0.*`, a speculators config, and
    the embedding included."""
    cfg = json.loads((src / "config.json").read_text())
    layer = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                                 "rope_theta")} | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"], "norm_before_residual": cfg["norm_before_residual"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
        "speculators_config": {"verifier": {"name_or_path": str(target)}}}))
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["embed_tokens.weight"] = torch.zeros(cfg["vocab_size"], cfg["hidden_size"])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def as_specforge(src: Path, dst: Path) -> Path:
    """SpecForge's layout: our names and config without eyas's own key, plus the embedding."""
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("eyas_draft_config")
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors")) | {"embed_tokens.weight": torch.zeros(3, 3)}
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("layout", ["eyas", "specforge", "speculators"])
def test_export_init_export_round_trip_is_identical(trained, fixture_target, tmp_path, layout) -> None:
    root, _ = trained
    src = root / "drafts" / "base"
    folder = {"eyas": lambda: src, "specforge": lambda: as_specforge(src, tmp_path / "sf"),
              "speculators": lambda: as_speculators(src, tmp_path / "sp", fixture_target)}[layout]()
    init = read_init_draft(str(folder))
    assert init.layout == layout and init.aux_layers == json.loads((src / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"]
    target = json.loads((fixture_target / "config.json").read_text())
    write_draft(tmp_path / "out", init.state, init.cfg, init.aux_layers, target)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (src, tmp_path / "out"))
    assert ca == cb


def test_refusals_name_the_problem(trained, tmp_path) -> None:
    root, _ = trained
    with pytest.raises(DatasetError, match="no config.json"):
        read_init_draft(str(tmp_path))
    bad = as_specforge(root / "drafts" / "base", tmp_path / "fc_norm")
    cfg = json.loads((bad / "config.json").read_text()) | {"norm_before_fc": True}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DatasetError, match="norm_before_fc set"):
        read_init_draft(str(bad))
    with pytest.raises(DatasetError, match="drafts/nosuch"):
        read_init_draft("nosuch", data_root=root)


def test_remap_reports_coverage(trained) -> None:
    root, hidden = trained
    from eyas_common.hidden import open_hidden
    from eyas_train.data import token_counts

    init = read_init_draft("base", data_root=root)
    counts = token_counts(open_hidden(hidden.ref, data_root=root), init.cfg.vocab_size)
    kept, report = init_vocab(init, counts, "keep", 512)
    assert torch.equal(kept.d2t, init.state["d2t"]) and "covers" in report
    remapped, report = init_vocab(init, counts, "remap", 64)
    assert remapped.d2t.numel() == 64 and "64 lm_head rows carried over" in report and "dropped" in report


def test_finetune_starts_at_the_drafts_accuracy(trained, fixture_target) -> None:
    root, hidden = trained
    base = log(root, "base")
    train_run(hidden=hidden.ref, model=fixture_target, name="fresh", data_root=root, epochs=1, **OPTS)
    train_run(hidden=hidden.ref, model=fixture_target, name="tuned", data_root=root, epochs=1,
              init_draft="drafts/base", **OPTS)
    fresh, tuned = log(root, "fresh")[0]["step_acc"][0], log(root, "tuned")[0]["step_acc"][0]
    print(f"step-0 accuracy: base after 4 epochs {base[-1]['step_acc'][0]:.3f}, first step of a fresh run "
          f"{fresh:.3f}, first step from --init-draft {tuned:.3f}")
    # The first batch of the finetune is scored by the trained weights (before any update).
    assert tuned > fresh + 0.1 and tuned >= 0.8 * max(r["step_acc"][0] for r in base[-6:])
    manifest = json.loads((root / "drafts" / "tuned" / "manifest.json").read_text())
    assert manifest["params"]["config"]["init_draft"] == "drafts/base"
