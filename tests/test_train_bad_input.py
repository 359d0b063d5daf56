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
import torch
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


# ------------------------------------------------------------------------------------------------
# 6. a --model that is not the hidden dataset's target, or whose files cannot be read


def other_target(fixture_target: Path, folder: Path, **change: int) -> Path:
    """A random Llama with the fixture's tokenizer and chat template (so the tokenizer check passes: another size
    of the same family) and `change` applied to the fixture's config."""
    cfg = json.loads((fixture_target / "config.json").read_text())
    cfg.pop("architectures", None)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**(cfg | change))).save_pretrained(folder)
    for f in fixture_target.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, folder / f.name)
    return folder


def test_a_model_sharing_the_tokenizer_but_not_the_target_is_refused_everywhere(base, fixture_target, tmp_path,
                                                                                 no_target_load):
    """run, export --model and eval each refuse it in one line naming what differs, before any work (no
    traceback from a shape mismatch deep in the draft's set-up)."""
    root, hidden = base
    cfg = json.loads((fixture_target / "config.json").read_text())
    other = other_target(fixture_target, tmp_path / "other", hidden_size=2 * cfg["hidden_size"])
    refused(cli(root, *train(hidden, other, "wrong_model")), f"--model {other} is not the target {hidden.ref}",
            f"hidden_size {2 * cfg['hidden_size']} (the dataset's: {cfg['hidden_size']})")
    assert not (root / "drafts" / "wrong_model").exists()
    refused(cli(root, "export", "base", "--out", "wrong_export", "--model", str(other)),
            f"--model {other} is not the target drafts/base was trained for")
    assert not (root / "drafts" / "wrong_export").exists()
    prompts = write_prompts_jsonl(root / "p.jsonl", 1, seed=2)
    refused(cli(root, "eval", "--draft", "drafts/base", "--model", str(other), "--prompts", str(prompts)),
            f"drafts/base was trained for another target ({fixture_target}): this one's config.json has hidden_size "
            f"{2 * cfg['hidden_size']} (the draft's: {cfg['hidden_size']})")


def test_a_model_with_a_cut_short_weights_file_is_refused_naming_it(base, fixture_target, tmp_path):
    root, hidden = base
    model = tmp_path / "model"
    shutil.copytree(fixture_target, model)
    weights = sorted(model.glob("*.safetensors"))[0]
    os.truncate(weights, 5000)
    refused(cli(root, *train(hidden, model, "cut_model")), f"--model {weights}: not a whole safetensors file",
            "pass the target")
    assert not (root / "drafts" / "cut_model").exists()


def test_export_of_a_draft_whose_target_moved_names_the_fix(base, fixture_target, tmp_path):
    """export reads the target's config (token ids, dtype) from where it was at training time: once it moved,
    export says so in one line, and --model gives it the new place."""
    root, _ = base
    ds = clone(root, "moved")
    m = ds.read_manifest()
    m["params"]["config"]["model"] = str(tmp_path / "gone")
    ds.write_manifest(m)
    refused(cli(root, "export", ds.name, "--step", "2", "--out", "moved_2"),
            f"drafts/moved was trained for the target at {tmp_path / 'gone'}", "pass --model")
    assert not (root / "drafts" / "moved_2").exists()
    r = cli(root, "export", ds.name, "--step", "2", "--out", "moved_2", "--model", str(fixture_target))
    assert r.exit_code == 0, r.output
    assert verify(Dataset.parse("moved_2", "drafts", root)) == []


# ------------------------------------------------------------------------------------------------
# 7. an --init-draft that is not a whole EAGLE-3 draft


def _init_config(folder: Path, change: Callable[[dict], None]) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _init_weights(folder: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


INIT_DAMAGES = {
    "config not JSON": (lambda f: (f / "config.json").write_text("{bad"), "config.json is not valid JSON"),
    "weights not safetensors": (lambda f: (f / "model.safetensors").write_bytes(random.Random(0).randbytes(4096)),
                                "model.safetensors is not a readable safetensors file"),
    "unknown config field": (lambda f: _init_config(f, lambda c: c["eyas_draft_config"].update(foo=1)),
                             "eyas_draft_config is not this eyas's draft config (got an unexpected keyword "
                             "argument 'foo')"),
    "shapes": (lambda f: _init_config(f, lambda c: c["eyas_draft_config"].update(intermediate_size=7)),
               "its tensors do not have the shapes"),
    "a tensor missing": (lambda f: _init_weights(f, lambda t: t.pop("fc.weight")),
                         "no fc.weight in model.safetensors"),
}


@pytest.mark.parametrize("damage", INIT_DAMAGES)
def test_an_init_draft_that_is_not_a_whole_draft_is_refused_before_training(base, fixture_target, tmp_path, damage):
    root, hidden = base
    init = tmp_path / "init"
    shutil.copytree(root / "drafts" / "base", init)
    hurt, says = INIT_DAMAGES[damage]
    hurt(init)
    name = "init_" + damage.replace(" ", "_")
    refused(cli(root, *train(hidden, fixture_target, name), "--init-draft", str(init)), f"--init-draft {init}",
            says)
    assert not (root / "drafts" / name).exists()


def test_a_target_folder_given_as_init_draft_is_refused_in_a_short_line(base, fixture_target):
    root, hidden = base
    line = refused(cli(root, *train(hidden, fixture_target, "init_target"), "--init-draft", str(fixture_target)),
                   "unexpected tensors in the draft file", "more (not an EAGLE-3 draft's")
    assert len(line) < 600, line


# ------------------------------------------------------------------------------------------------
# 8. option values that could only be wrong


def test_epochs_that_round_to_no_step_are_refused(base, fixture_target):
    """12 samples at batch 4 are 3 steps a pass: --epochs 0.1 would export the untrained draft as if trained."""
    root, hidden = base
    args = train(hidden, fixture_target, "few_epochs")
    args[args.index("--epochs") + 1] = "0.1"
    refused(cli(root, *args), "--epochs 0.1 is 0.3 of the 3 steps a pass", "at least --epochs 0.333 (one step)")
    assert not (root / "drafts" / "few_epochs").exists()


@pytest.mark.parametrize("extra, says", [
    (["--ttt-steps", "33"], "'--ttt-steps': 33 is not in the range 1<=x<=32"),
    (["--seed", str(2**63)], "'--seed': 9223372036854775808 is not in the range 0<=x<=4294967295"),
    (["--block-size", "4"], "[METHOD_OPTION] --block-size"),
    (["--method", "dflash", "--init-draft", "drafts/base"], "[METHOD_OPTION] --init-draft"),
    (["--method", "dflash", "--head-negatives", "256"], "[METHOD_OPTION] --head-negatives"),
    (["--method", "dflash", "--order", "shards"], "[METHOD_NO_STREAM] --method dflash"),
])
def test_options_a_run_would_ignore_or_run_out_of_memory_with_are_refused(base, fixture_target, extra, says):
    root, hidden = base
    r = cli(root, *train(hidden, fixture_target, "ignored"), *extra)
    assert r.exit_code == 2 and says in r.output, r.output
    assert not (root / "drafts" / "ignored").exists()


def test_a_mask_token_outside_the_vocabulary_is_one_line(base, fixture_target):
    root, hidden = base
    refused(cli(root, *train(hidden, fixture_target, "dfl_mask"), "--method", "dflash", "--mask-token-id",
                "1000000000"), "--mask-token-id 1000000000 is outside the target vocabulary", "pass an id below")


def test_a_hidden_manifest_without_its_layers_is_one_line(base, fixture_target, tmp_path):
    root, hidden = base
    data = tmp_path / "data"
    shutil.copytree(hidden.path, data / "hidden" / hidden.name)
    copy = Dataset.parse(hidden.name, "hidden", data)
    m = copy.read_manifest()
    del m["params"]["layers"]
    copy.write_manifest(m)
    refused(cli(data, *train(copy, fixture_target, "no_layers")), f"{copy.manifest_path} has no valid params.layers",
            "eyas-data rm hidden/")


# ------------------------------------------------------------------------------------------------
# 9. eval prompts the target's template refuses, before the target is loaded


def test_eval_refuses_a_prompt_the_chat_template_refuses_before_loading_the_target(base, fixture_target,
                                                                                  no_target_load):
    root, _ = base
    prompts = root / "roles.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                       + json.dumps({"messages": [{"role": "tool", "content": "x"},
                                                  {"role": "user", "content": "hi"}]}) + "\n")
    refused(cli(root, "eval", "--draft", "drafts/base", "--model", str(fixture_target), "--prompts", str(prompts)),
            f"--prompts {prompts}: prompt 2 (roles tool, user): the target's chat template refuses it")


def test_eval_refuses_an_unknown_device_map_before_any_work(base, fixture_target, no_target_load):
    root, _ = base
    prompts = write_prompts_jsonl(root / "p.jsonl", 1, seed=2)
    refused(cli(root, "eval", "--draft", "drafts/base", "--model", str(fixture_target), "--prompts", str(prompts),
                "--device-map", "junk"), "--device-map junk: expected auto, balanced")


def test_a_max_len_that_keeps_no_completion_token_is_refused(base, fixture_target):
    """--max-len 2 cuts every sample inside its prompt: the draft would train on nothing, and say loss 0."""
    root, hidden = base
    refused(cli(root, *train(hidden, fixture_target, "short"), "--max-len", "2"),
            f"--max-len 2 keeps no completion token of {hidden.ref}", "raise it")
    assert not (root / "drafts" / "short").exists()


def test_a_resume_after_the_target_moved_says_how_to_resume(base, fixture_target, tmp_path):
    """--model is part of the settings a resume must repeat; once the target moved, the old path cannot be given
    again, so the refusal says how to make it work (a link), and the link resumes."""
    import torch

    base_root, hidden = base
    root = linked_root(base_root, tmp_path)
    ds = clone(base_root, "base", into=root)
    ds.write_manifest({**ds.read_manifest(), "status": "partial"})  # as if its run had been killed
    gone = tmp_path / "gone"
    for ckpt in (ds.path / "checkpoints").glob("step-*.pt"):
        payload = torch.load(ckpt, weights_only=False)
        payload["config"]["model"] = str(gone)
        torch.save(payload, ckpt)
    refused(cli(root, *train(hidden, fixture_target, ds.name)), f"the target is no longer at {gone}: link it there",
            f"`ln -s {fixture_target} {gone}`", "resume from its checkpoint at step 3")
    gone.symlink_to(fixture_target)  # the fix the line gives
    r = cli(root, *train(hidden, gone, ds.name))
    assert r.exit_code == 0 and "resuming at step 3" in r.output, r.output


def test_a_run_from_an_init_draft_resumes_after_that_draft_is_gone(base, fixture_target, tmp_path):
    """The init draft is read once: a resumed run takes its weights from the checkpoint and its shape from the
    manifest, so deleting (or moving) the init draft after the start does not strand the checkpoints."""
    base_root, hidden = base
    root = linked_root(base_root, tmp_path)
    clone(base_root, "init_src", into=root)
    args = [*train(hidden, fixture_target, "fine"), "--init-draft", "drafts/init_src"]
    assert cli(root, *args).exit_code == 0
    ds = Dataset.parse("fine", "drafts", root)
    ds.write_manifest({**ds.read_manifest(), "status": "partial"})  # as if killed before its last checkpoint
    (ds.path / "checkpoints" / "step-00000003.pt").unlink()
    shutil.rmtree(root / "drafts" / "init_src")
    r = cli(root, *args)
    assert r.exit_code == 0 and "resuming at step 2" in r.output, r.output
    assert ds.read_manifest()["status"] == "complete" and verify(ds) == []


def test_out_of_accelerator_memory_is_one_line_with_what_fits(base, fixture_target, monkeypatch):
    """A CUDA out-of-memory in a step was a traceback; it says what to change, and that a resume keeps the batch.
    (On this CPU the step raises it as torch does on a GPU.)"""
    from eyas_train.ttt import UnrolledLoss

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total)")

    root, hidden = base
    monkeypatch.setattr(UnrolledLoss, "forward", oom)
    refused(cli(root, *train(hidden, fixture_target, "oom")), "out of cpu memory (CUDA out of memory); drafts/oom "
            "keeps no checkpoint yet, but a resume keeps the batch: start a new --name with a smaller --batch-size")
