"""Stage 03 runs on a small fixture dataset: the CLI end to end (manifest, lineage, files, refusals),
2-process torchrun (DDP and FSDP2 on gloo) against one process, kill and resume against an
uninterrupted run, export of a checkpoint, and the offline eval."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from eyas_common.contract import Dataset, DatasetError, verify
from eyas_testing.fixture import write_prompts_jsonl
from eyas_train.cli import main as train_cli
from eyas_train.eval import evaluate
from eyas_train.parallel import native_bf16_cpu
from eyas_train.export_ckpt import export_checkpoint

from eyas_testing.datasets import build_datasets
from eyas_testing.servers import free_port

BIN = Path(sys.executable).parent
# 24 samples, batch 4: 6 steps per epoch (no validation slice: these tests compare runs step by step).
ARGS = ["--draft-vocab", "512", "--ttt-steps", "3", "--batch-size", "4", "--lr", "3e-3", "--log-every", "2",
        "--val-samples", "0"]


@pytest.fixture(scope="module")
def data(fixture_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_run")
    return root, build_datasets(root, fixture_target, 24, seed=5, per_shard=10)


def env_for(root: Path) -> dict[str, str]:
    # Two processes on two cores: one thread each, so they do not fight over the cores.
    return {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def cmd(hidden: Dataset, model: Path, name: str, *extra: str) -> list[str]:
    return ["run", "--hidden", hidden.ref, "--model", str(model), "--name", name, *ARGS, *extra]


def weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(root / "drafts" / name / "model.safetensors"))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), (k, (a[k].float() - b[k].float()).abs().max())


def test_cli_run_writes_a_complete_draft(data, fixture_target, monkeypatch):
    root, hidden = data
    monkeypatch.setenv("EYAS_DATA", str(root))
    r = CliRunner().invoke(train_cli, cmd(hidden, fixture_target, "one", "--epochs", "2", "--ckpt-every", "5"))
    assert r.exit_code == 0, r.output
    ds = Dataset.parse("one", "drafts", root)
    m = ds.read_manifest()
    assert m["schema"] == "eyas.drafts/1" and m["status"] == "complete" and verify(ds) == []
    assert [i["ref"] for i in m["inputs"]] == [hidden.ref, "synth/fixture_24_5"]
    assert m["target"]["tokenizer_sha256"] == hidden.read_manifest()["target"]["tokenizer_sha256"]
    assert m["producer"]["stage"] == "03_train" and m["params"]["config"]["ttt_steps"] == 3
    assert m["params"]["total_steps"] == 12 and m["stats"]["draft_vocab"] == 512
    # --precision auto: bf16 where this CPU multiplies bf16 natively, recorded and printed as resolved
    resolved = "bf16" if native_bf16_cpu() else "fp32"
    assert m["params"]["precision"] == resolved and f"cpu in {resolved};" in r.output
    assert 0 < m["stats"]["vocab_coverage"] <= 1 and len(m["stats"]["final"]["step_acc"]) == 3
    # where the data holds fewer distinct tokens than the draft vocabulary, the line says what fills the rest
    distinct = m["stats"]["distinct_tokens"]
    assert (f"({distinct} distinct; its other {512 - distinct} are the lowest unseen ids" in r.output) == (distinct < 512)
    names = {f["name"] for f in m["files"]}
    assert {"config.json", "model.safetensors", "training.png", "train_log.jsonl", "README.md"} <= names
    # the model card, as the Hub shows it: front matter, the target, the lineage, the steps trained
    card = (ds.path / "README.md").read_text()
    assert card.startswith("---\nbase_model: ") and f"`{m['target']['model']}`" in card
    assert all(f"`{i['ref']}`" in card for i in m["inputs"]) and f"Steps {m['stats']['steps']}," in card
    assert sorted(p.name for p in (ds.path / "checkpoints").iterdir()) == ["step-00000010.pt", "step-00000012.pt"]
    log = [json.loads(line) for line in (ds.path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6, 8, 10, 12] and log[-1]["loss"] < log[0]["loss"]
    assert (ds.path / "training.png").read_bytes()[:4] == b"\x89PNG"
    # a finished draft is not overwritten by accident
    r = CliRunner().invoke(train_cli, cmd(hidden, fixture_target, "one", "--epochs", "2"))
    assert r.exit_code != 0 and "already complete" in r.output

    # export of an earlier checkpoint as a complete snapshot, with lineage back to the run
    out = export_checkpoint("one", step=10, out="one_step10", data_root=root)
    snap = Dataset.parse("one_step10", "drafts", root).read_manifest()
    assert snap["status"] == "complete" and snap["stats"]["exported_step"] == 10
    assert [i["ref"] for i in snap["inputs"]][:2] == ["drafts/one", hidden.ref]
    assert weights(root, "one_step10").keys() == weights(root, "one").keys()
    assert not torch.equal(weights(root, "one_step10")["fc.weight"], weights(root, "one")["fc.weight"])
    assert (out / "config.json").read_text() == (ds.path / "config.json").read_text()
    assert "- `drafts/one`" in (out / "README.md").read_text()  # the snapshot's card names the run it came from
    with pytest.raises(DatasetError, match="no checkpoint at step 3"):
        export_checkpoint("one", step=3, data_root=root)

    # offline eval runs and counts like vLLM: accepted tokens never exceed the drafts' tokens
    prompts = write_prompts_jsonl(root / "p.jsonl", 3, seed=2)
    res = evaluate(draft="drafts/one", model=fixture_target, prompts=prompts, spec_tokens=3, data_root=root,
                   max_tokens=40)
    assert res["prompts"] == 3 and res["drafts"] > 0 and 0 <= res["accepted"] <= 3 * res["drafts"]
    assert res["acceptance_length"] == pytest.approx(1 + sum(res["per_position"]))


def test_refuses_changed_settings_on_resume(data, fixture_target, monkeypatch):
    root, hidden = data
    monkeypatch.setenv("EYAS_DATA", str(root))
    ds = Dataset.parse("changed", "drafts", root)
    r = CliRunner().invoke(train_cli, cmd(hidden, fixture_target, "changed", "--epochs", "1", "--ckpt-every", "2"))
    assert r.exit_code == 0, r.output
    m = ds.read_manifest()
    m["status"] = "partial"  # as if the run had been killed after its last checkpoint
    ds.write_manifest(m)
    r = CliRunner().invoke(train_cli, cmd(hidden, fixture_target, "changed", "--epochs", "1", "--lr", "1e-2"))
    assert r.exit_code != 0 and "lr=0.003 (now 0.01)" in r.output


def run_cli(args: list[str], root: Path, procs: int = 1) -> subprocess.CompletedProcess:
    if procs == 1:
        full = [str(BIN / "eyas-train"), *args]
    else:
        full = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={procs}", "-m", "eyas_train", *args]
    return subprocess.run(full, env=env_for(root), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.slow  # torchrun training: not in `make test-fast`
def test_torchrun_two_processes_equal_one(data, fixture_target, mode):
    root, hidden = data
    # fp32: bf16 products (--precision auto on a CPU with bf16) round each rank's partial sums apart
    fp32 = ("--epochs", "2", "--precision", "fp32")
    if not (root / "drafts" / "single").exists():
        r = run_cli(cmd(hidden, fixture_target, "single", *fp32), root)
        assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(cmd(hidden, fixture_target, f"two_{mode}", *fp32, "--parallel", mode), root, procs=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m = Dataset.parse(f"two_{mode}", "drafts", root).read_manifest()
    assert m["params"]["world"] == 2 and m["status"] == "complete"
    # Same global batch, split over two processes: equal up to float summation order.
    assert_close(weights(root, "single"), weights(root, f"two_{mode}"), atol=2e-5)
    one = Dataset.parse("single", "drafts", root).read_manifest()["stats"]["final"]
    assert m["stats"]["final"]["step_acc"] == pytest.approx(one["step_acc"], abs=0.02)


def torchrun_nodes(root: Path, args: list[str], run_id: str, port: int, nodes: int = 2) -> list[subprocess.Popen]:
    """NODES torchrun agents of one process each, joined by the c10d rendezvous on 127.0.0.1:PORT, as
    `make train HOSTS=...` starts one per host."""
    line = [str(BIN / "torchrun"), "--nnodes", str(nodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "-m", "eyas_train", *args]
    return [subprocess.Popen(line, env=env_for(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True) for _ in range(nodes)]


@pytest.mark.slow  # torchrun nodes killed and rerun
def test_a_node_killed_mid_run_stops_the_other_in_one_line_and_the_rerun_resumes(data, fixture_target):
    import psutil

    root, hidden = data
    args = cmd(hidden, fixture_target, "two_nodes", "--epochs", "40", "--ckpt-every", "6")
    first = torchrun_nodes(root, args, "first", free_port())
    ckpt = root / "drafts/two_nodes/checkpoints/step-00000012.pt"
    deadline = time.monotonic() + 300
    while not ckpt.exists():
        assert all(p.poll() is None for p in first) and time.monotonic() < deadline, "no checkpoint at step 12"
        time.sleep(0.05)
    killed = psutil.Process(first[1].pid)
    for p in [killed, *killed.children(recursive=True)]:  # the host is gone: its agent and its worker
        p.kill()
    out = first[0].communicate(timeout=120)[0]
    first[1].wait()
    assert first[0].returncode != 0
    said = [line for line in out.splitlines() if "another process of this run is gone" in line]
    assert len(said) == 1 and "Traceback" not in out.split(said[0])[0], out[-3000:]
    assert "rerun the same command on every host to resume" in said[0] and "keeps step-" in said[0], said
    assert Dataset.parse("two_nodes", "drafts", root).read_manifest()["status"] == "partial"

    rerun = torchrun_nodes(root, args, "second", free_port())
    outs = [p.communicate(timeout=600)[0] for p in rerun]
    assert [p.returncode for p in rerun] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "resuming at step" in "".join(outs)
    m = Dataset.parse("two_nodes", "drafts", root).read_manifest()
    assert m["status"] == "complete" and m["params"]["world"] == 2


@pytest.mark.slow  # training killed and resumed: not in `make test-fast`
def test_kill_and_resume_equals_uninterrupted(data, fixture_target):
    root, hidden = data
    args = cmd(hidden, fixture_target, "resumed", "--epochs", "6", "--ckpt-every", "3")
    ds = Dataset.parse("resumed", "drafts", root)
    proc = subprocess.Popen([str(BIN / "eyas-train"), *args], env=env_for(root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list((ds.path / "checkpoints").glob("step-*.pt")) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ds.read_manifest()["status"] == "partial", "the run finished before it could be killed"
    killed_at = max(int(p.stem[5:]) for p in (ds.path / "checkpoints").glob("step-*.pt"))
    assert killed_at < 36

    r = run_cli(args, root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming at step {killed_at}" in r.stderr
    r = run_cli(cmd(hidden, fixture_target, "straight", "--epochs", "6", "--ckpt-every", "3"), root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(weights(root, "resumed"), weights(root, "straight"), atol=1e-6)
    log = [json.loads(line) for line in (ds.path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(2, 37, 2))  # the log was cut back and continued, no repeats


@pytest.mark.slow  # trains until it stops: not in `make test-fast`
def test_early_stopping_exports_the_best_validated_draft(data, fixture_target):
    """16 training samples at a 10x rate overfit within a few epochs: the validation slice (8 samples held out
    by id) stops improving, the run stops after --patience validations, and the draft it exports is the best
    validated one, not the last."""
    root, hidden = data
    r = run_cli(["run", "--hidden", hidden.ref, "--model", str(fixture_target), "--name", "early", "--draft-vocab",
                 "512", "--ttt-steps", "3", "--batch-size", "4", "--lr", "3e-2", "--epochs", "40", "--val-samples",
                 "8", "--eval-every", "4", "--patience", "3", "--log-every", "4"], root)
    assert r.returncode == 0, r.stderr[-3000:]
    ds = Dataset.parse("early", "drafts", root)
    m = ds.read_manifest()
    assert m["status"] == "complete" and verify(ds) == []
    assert m["params"]["recipe"]["train_samples"] == 16 and m["params"]["recipe"]["val_samples"] == 8
    vals = [json.loads(x) for x in (ds.path / "train_log.jsonl").read_text().splitlines() if '"val_' in x]
    best = vals[0]
    for v in vals[1:]:  # the first validation that no later one beats by more than 1e-3
        best = v if v["val_predicted"][-1] > best["val_predicted"][-1] + 1e-3 else best
    stats = m["stats"]
    assert stats["stopped_early"] and stats["steps"] < m["params"]["total_steps"] == 160, stats
    assert stats["steps"] == vals[-1]["step"] == best["step"] + 3 * 4
    assert stats["exported_step"] == best["step"] and stats["val"] == best
    assert stats["predicted_acceptance"]["3"] == best["val_predicted"][2]
    assert f"stopping early at step {stats['steps']}" in r.stderr
    assert f"predicted acceptance length at 3 speculative tokens {best['val_predicted'][2]:.2f}" in r.stderr
    # the exported weights are the best validation's, and differ from the last step's
    exported = weights(root, "early")["fc.weight"]
    best_sd = torch.load(ds.path / "checkpoints" / "best.pt", weights_only=False)
    last_sd = torch.load(sorted((ds.path / "checkpoints").glob("step-*.pt"))[-1], weights_only=False)
    assert best_sd["step"] == best["step"] and last_sd["step"] == stats["steps"]
    assert torch.equal(exported, best_sd["model"]["draft.fc.weight"].to(exported.dtype))
    assert not torch.equal(exported, last_sd["model"]["draft.fc.weight"].to(exported.dtype))
