"""Stage 03 on bad input: damaged checkpoints, draft folders no server could load, an unknown manifest schema,
a full disk, an --out that cannot be written. Each is refused in one line that names the file or option and
the fix, before any expensive work, and nothing finished is lost."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import transformers
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from eyas_common.contract import Dataset, verify, write_json_atomic
from eyas_testing.datasets import build_datasets
from eyas_testing.fixture import write_prompts_jsonl
from eyas_train.cli import main as train_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 12 samples at batch 4: 3 steps, a checkpoint after each (about 3.4 MB apiece), all three kept.
TRAIN = ["--draft-vocab", "256", "--ttt-steps", "2", "--batch-size", "4", "--val-samples", "0", "--epochs", "1",
         "--ckpt-every", "1", "--keep-ckpts", "3", "--log-every", "1"]


@pytest.fixture(scope="module")
def base(fixture_target, tmp_path_factory) -> tuple[Path, Dataset]:
    """A data root holding hidden/fixture_12_5_10 and drafts/base, trained 3 steps (about 10 s)."""
    root = tmp_path_factory.mktemp("bad_input")
    hidden = build_datasets(root, fixture_target, 12, seed=5, per_shard=10)
    r = cli(root, *train(hidden, fixture_target, "base"))
    assert r.exit_code == 0, r.output
    return root, hidden


def train(hidden: Dataset, model: Path, name: str) -> list[str]:
    return ["run", "--hidden", hidden.ref, "--model", str(model), "--name", name, *TRAIN]


def cli(root: Path, *args: str) -> Result:
    return CliRunner().invoke(train_cli, list(args), env={"EYAS_DATA": str(root)})


def refused(r: Result, *says: str) -> str:
    """The CLI stopped with one `Error:` line (exit 1, no traceback) holding every one of `says`."""
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, r.output[-3000:])
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("Error: ") and all(s in line for s in says), line
    return line


def clone(root: Path, name: str, into: Path | None = None) -> Dataset:
    """A copy of drafts/base as drafts/NAME, under `root` or under another data root `into`."""
    shutil.copytree(root / "drafts" / "base", (into or root) / "drafts" / name)
    return Dataset.parse(name, "drafts", into or root)


def linked_root(root: Path, tmp_path: Path) -> Path:
    """Another data root with the same synth and hidden datasets (linked) and no drafts yet."""
    data = tmp_path / "data"
    data.mkdir()
    for kind in ("synth", "hidden"):
        (data / kind).symlink_to(root / kind)
    return data


def contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_target_load(monkeypatch) -> None:
    """Loading the target (the eval's expensive work) fails the test: every refusal must come before it."""
    def loaded(*a, **k):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)


@contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Callable[[str], None]]:
    """A tmpfs mounted at `path` with `options` (a small size, or ro), unmounted after; yields a function that
    remounts it with other options (more room). Skipped where mounting is not allowed (it needs root)."""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root: these tests fill (or write to) a real small volume")
    try:
        yield lambda more: subprocess.run(["mount", "-o", f"remount,{more}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# ------------------------------------------------------------------------------------------------
# 1. a damaged checkpoint


@pytest.mark.parametrize("damage", ["truncated", "empty", "random bytes"])
def test_an_unreadable_checkpoint_is_refused_naming_the_one_to_use(base, fixture_target, damage, tmp_path):
    """Checkpoints are renamed into place whole, so an unreadable one was damaged on disk: resume and export
    refuse it in one line that says which readable checkpoint to use instead, and change nothing."""
    base_root, hidden = base
    root = linked_root(base_root, tmp_path)
    ds = clone(base_root, "base", into=root)  # a resume needs the run's own name
    ds.write_manifest({**ds.read_manifest(), "status": "partial"})  # as if its run had been killed
    bad = ds.path / "checkpoints" / "step-00000003.pt"
    size = bad.stat().st_size
    if damage == "random bytes":
        bad.write_bytes(random.Random(0).randbytes(size))
    else:
        os.truncate(bad, size // 2 if damage == "truncated" else 0)
    before = contents(ds.path)
    refused(cli(root, *train(hidden, fixture_target, ds.name)), f"{bad}: unreadable checkpoint",
            "delete it and rerun the same command to resume from step-00000002.pt")
    refused(cli(root, "export", ds.name), f"{bad}: unreadable checkpoint", "export --step 2")
    snap = f"{ds.name}_3"
    refused(cli(root, "export", ds.name, "--step", "3", "--out", snap), f"{bad}: unreadable", "--step 2")
    assert contents(ds.path) == before and not (root / "drafts" / snap).exists()
    bad.unlink()  # the fix the line gives
    r = cli(root, *train(hidden, fixture_target, ds.name))
    assert r.exit_code == 0 and "resuming at step 2" in r.output, r.output
    assert ds.read_manifest()["status"] == "complete"


# ------------------------------------------------------------------------------------------------
# 2. a draft folder no server could load, refused by eval from its header alone


def _edit_config(ds: Dataset, change: Callable[[dict], None]) -> None:
    cfg = json.loads((ds.path / "config.json").read_text())
    change(cfg)
    write_json_atomic(ds.path / "config.json", cfg)


def _aux_ids(cfg: dict) -> None:
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 9]


def _new_weights(ds: Dataset) -> None:
    tensors = load_file(str(ds.path / "model.safetensors"))
    tensors["fc.weight"] += 1  # the same shapes, other values: only the manifest's sha256 tells
    save_file(tensors, str(ds.path / "model.safetensors"), metadata={"format": "pt"})  # as export does


DAMAGES = {
    "truncated weights": (lambda ds: os.truncate(ds.path / "model.safetensors", 100_000),
                          "model.safetensors: not a whole safetensors file (100,000 bytes, but its header describes"),
    "aux ids": (lambda ds: _edit_config(ds, _aux_ids),
                "config.json: eagle_aux_hidden_state_layer_ids [2, 4, 9] name layers the target does not have (it "
                "has 8"),
    "hidden_size": (lambda ds: _edit_config(ds, lambda c: c.update(hidden_size=256)),
                    "config.json: hidden_size is 256, but model.safetensors holds fc.weight of shape [128, 384]"),
    "draft_vocab_size": (lambda ds: _edit_config(ds, lambda c: c.update(draft_vocab_size=128)),
                         "config.json: draft_vocab_size is 128, but model.safetensors holds lm_head.weight of shape "
                         "[256, 128]"),
    "eyas_draft_config": (lambda ds: _edit_config(ds, lambda c: c["eyas_draft_config"].update(hidden_size=64)),
                          "config.json: eyas_draft_config.hidden_size is 64, but the top level (what servers read) "
                          "says 128"),
    "other weights": (_new_weights, "model.safetensors: sha256 differs from the manifest"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_eval_refuses_a_draft_folder_no_server_could_load_before_loading_the_target(base, fixture_target, damage,
                                                                                    no_target_load):
    root, _ = base
    ds = clone(root, "eval_" + damage.replace(" ", "_"))
    hurt, says = DAMAGES[damage]
    hurt(ds)
    prompts = write_prompts_jsonl(root / "p.jsonl", 1, seed=2)
    refused(cli(root, "eval", "--draft", ds.ref, "--model", str(fixture_target), "--prompts", str(prompts)), says)



def test_a_dflash_draft_folder_is_checked_by_its_own_layout(tmp_path):
    """check_folder reads a DFlash export (its layers, q/k norms, no lm_head) as the servers would."""
    from eyas_common.contract import DatasetError, finalize, new_manifest
    from eyas_common.drafts import check_folder
    from eyas_train.dflash import DFlashConfig, DFlashDraft
    from eyas_train.dflash_export import write_dflash_draft

    cfg = DFlashConfig(vocab_size=50, hidden_size=32, target_hidden_size=32, num_features=3, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       rms_norm_eps=1e-6, max_position_embeddings=256, block_size=4, mask_token_id=49)
    ds = Dataset.parse("dfl", "drafts", tmp_path)
    write_dflash_draft(ds.path, DFlashDraft(cfg).state_dict(), cfg, [2, 4, 6], {"num_hidden_layers": 8})
    finalize(ds, new_manifest("drafts", stage="03_train", target=None, inputs=[], params={}), stats={})
    assert check_folder(ds, ds.read_manifest(), {"num_hidden_layers": 8})["block_size"] == 4
    with pytest.raises(DatasetError, match=r"target_layer_ids \[1, 3, 5\] name layers the target does not have"):
        check_folder(ds, ds.read_manifest(), {"num_hidden_layers": 4})
    _edit_config(ds, lambda c: c.update(num_hidden_layers=1) or c["eyas_draft_config"].update(num_hidden_layers=1))
    with pytest.raises(DatasetError, match=r"model.safetensors: its tensors are not the ones config.json describes "
                                           r"\(missing \[\], not described \['layers.1.input_layernorm.weight'"):
        check_folder(ds, ds.read_manifest())


# ------------------------------------------------------------------------------------------------
# 3. an unknown manifest schema


def test_export_refuses_an_unknown_schema_and_changes_nothing(base):
    root, _ = base
    ds = clone(root, "schema9")
    ds.write_manifest({**ds.read_manifest(), "schema": "eyas.drafts/9"})
    before = contents(ds.path)
    for extra in ((), ("--step", "2", "--out", "schema9_2")):
        refused(cli(root, "export", ds.name, *extra), "drafts/schema9: schema 'eyas.drafts/9'", "eyas.drafts/1")
    assert contents(ds.path) == before and not (root / "drafts" / "schema9_2").exists()


def test_an_earlier_step_exported_into_a_complete_draft_keeps_it_intact(base, fixture_target):
    """The manifest of a complete draft is hashed again on export, so the draft still passes its readers' checks."""
    root, _ = base
    ds = clone(root, "restep")
    assert cli(root, "export", ds.name, "--step", "2").exit_code == 0
    m = ds.read_manifest()
    assert m["status"] == "complete" and m["stats"]["exported_step"] == 2 and verify(ds) == []
    prompts = write_prompts_jsonl(root / "p.jsonl", 1, seed=2)
    r = cli(root, "eval", "--draft", ds.ref, "--model", str(fixture_target), "--prompts", str(prompts),
            "--max-tokens", "8")
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------------------------------------
# 4. a full disk (a real one: a small tmpfs)


def test_a_full_disk_while_training_is_one_line_and_the_rerun_resumes(base, fixture_target, tmp_path):
    root, hidden = base
    data = linked_root(root, tmp_path)
    with tmpfs(data / "drafts", "size=5m") as remount:  # room for one checkpoint, not two
        r = cli(data, *train(hidden, fixture_target, "full"))
        ckpts = data / "drafts" / "full" / "checkpoints"
        refused(r, f"disk full while writing {ckpts / 'step-00000002.pt'}", "free space or point EYAS_DATA at a "
                "larger volume, then rerun the same command")
        assert [p.name for p in ckpts.iterdir()] == ["step-00000001.pt"]  # no temp file left, step 1 kept
        remount("size=64m")
        r = cli(data, *train(hidden, fixture_target, "full"))
        assert r.exit_code == 0 and "resuming at step 1" in r.output, r.output
        assert Dataset.parse("full", "drafts", data).read_manifest()["status"] == "complete"


def test_a_full_disk_while_exporting_is_one_line_and_leaves_nothing_behind(base, tmp_path):
    root, _ = base
    data = tmp_path / "data"
    with tmpfs(data / "drafts", "size=600k") as remount:  # model.safetensors takes 0.6 MB
        (data / "drafts" / "base").symlink_to(root / "drafts" / "base")
        args = ("export", "base", "--step", "2", "--out", "d9")
        refused(cli(data, *args), f"disk full while writing {data / 'drafts' / 'd9' / 'model.safetensors'}",
                "then rerun the same command")
        assert sorted(p.name for p in (data / "drafts").iterdir() if not p.name.endswith(".lock")) == ["base"]
        remount("size=64m")
        assert cli(data, *args).exit_code == 0  # the same command, not refused as "already exists"
        assert verify(Dataset.parse("d9", "drafts", data)) == []


# ------------------------------------------------------------------------------------------------
# 5. an --out the eval could not write, refused before the evaluation


@pytest.mark.parametrize("where", ["under a file", "read-only volume"])
def test_eval_refuses_an_out_it_cannot_write_before_evaluating(base, fixture_target, tmp_path, where, no_target_load):
    root, _ = base
    prompts = write_prompts_jsonl(root / "p.jsonl", 1, seed=2)
    args = ("eval", "--draft", "drafts/base", "--model", str(fixture_target), "--prompts", str(prompts), "--out")
    if where == "under a file":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "x.json"
        refused(cli(root, *args, str(out)), f"--out {out}: cannot write in {tmp_path / 'file'} (Not a directory)")
        return
    with tmpfs(tmp_path / "ro", "ro,size=1m"):
        out = tmp_path / "ro" / "new" / "x.json"
        refused(cli(root, *args, str(out)), f"--out {out}: cannot write in {tmp_path / 'ro'} (Read-only file system)")
