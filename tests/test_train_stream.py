"""Streaming, step 2 (issue 20): `eyas-train run --follow` on a hidden dataset still being written.

The test lists the shards of a finished extraction one by one into a second hidden dataset, as
`eyas-extract run --follow` lists them (partial manifest, writer lock held, each final shard's entry), and
checks that the followed training, SIGKILLed mid-run and rerun, gives the draft an offline `--order shards`
training over the finished dataset gives: the same log, step by step, and the same weights."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import torch

from safetensors.torch import load_file

import eyas_common.lock
from eyas_common.chat import load_tokenizer
from eyas_common.contract import Dataset, DatasetError, sha256_file
from eyas_common.hidden import (consumed_marks, consumer_alive, consumer_error, made_shards, parse_size,
                                shard_bytes, size_text, update_manifest)
from eyas_common.hidden import consuming as consumer_lock
from eyas_extract.follow import wait_for_budget
from eyas_common.lock import WriterLock

from eyas_testing.datasets import build_datasets
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.peak import PeakBytes
from eyas_testing.stub import start_stub
from eyas_train.cli import main as train_cli
from helpers import assert_refused, make, rendering_answer

# 24 samples in 8 shards of 3; windows of 2 shards; 2 held out from the first window; batch 4: the first pass
# streams 5 batches of the 22 training samples, the second pass is a seeded epoch over all of them. fp32: two
# processes must equal one, and bf16 products would round each rank's partial sums apart.
ARGS = ["--draft-vocab", "512", "--ttt-steps", "3", "--batch-size", "4", "--lr", "3e-3", "--log-every", "1",
        "--val-samples", "2", "--eval-every", "5", "--epochs", "2", "--window-shards", "2", "--ckpt-every", "1",
        "--precision", "fp32"]
ONE_PASS = [a if ARGS[i - 1] != "--epochs" else "1" for i, a in enumerate(ARGS)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(fixture_target, tmp_path_factory) -> tuple[Path, Dataset]:
    root = tmp_path_factory.mktemp("train_stream")
    return root, build_datasets(root, fixture_target, 24, seed=5, per_shard=3)


class LiveHidden:
    """A hidden dataset listed the way `eyas-extract run --follow` lists it: a partial manifest with no shard
    count, the extract worker's lock held, each shard copied in and then listed as final."""

    def __init__(self, root: Path, source: Dataset, name: str):
        self.source, self.final = source, source.read_manifest()
        self.ds = Dataset.parse(name, "hidden", root)
        self.ds.path.mkdir(parents=True)
        self.manifest = {**self.final, "status": "partial", "files": [], "stats": {},
                         "params": {**self.final["params"], "num_shards": 0}}
        self.ds.write_manifest(self.manifest)
        self.lock: WriterLock | None = None

    def start_writer(self) -> None:
        self.lock = WriterLock(self.ds, stage="02_extract", part="worker-0-of-1").acquire()

    def add(self, *names: str) -> None:
        entries = {f["name"]: f for f in self.final["files"]}
        for name in names:
            shutil.copy(self.source.path / name, self.ds.path / name)
            self.manifest["files"].append(entries[name])
        update_manifest(self.ds, self.manifest)  # as extract lists a shard: the consumed marks are kept

    def complete(self) -> None:
        made = made_shards(self.ds)  # consumed shards stay deleted, as extract's finalize leaves them
        for f in self.final["files"]:
            if f["name"] not in made and not (self.ds.path / f["name"]).exists():
                (self.ds.path / f["name"]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.source.path / f["name"], self.ds.path / f["name"])
        update_manifest(self.ds, json.loads(json.dumps(self.final)))
        self.lock.release()


def shard_names(hidden: Dataset) -> list[str]:
    return sorted(f["name"] for f in hidden.read_manifest()["files"] if f["name"].startswith("shard-"))


def weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(root / "drafts" / name / "model.safetensors"))


def train_log(root: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "drafts" / name / "train_log.jsonl").read_text().splitlines()]


def follow_cli(root: Path, target: Path, hidden: str, name: str, log: Path, *args: str,
               procs: int = 1) -> subprocess.Popen:
    env = {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = [sys.executable, "-m", "eyas_train.cli"] if procs == 1 else \
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={procs}", "-m", "eyas_train"]
    cmd = [*launcher, "run", "--hidden", hidden, "--model", str(target), "--name", name,
           "--follow", "--poll-seconds", "0.05", *(args or ARGS)]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(what: str, done, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"train ended (exit {proc.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{log.read_text()}"
        time.sleep(0.05)


def train_offline(root: Path, hidden: Dataset, target: Path, name: str = "offline", args: list[str] = ARGS) -> None:
    """drafts/NAME: one process over the finished dataset in shard order, what every followed run must equal."""
    if (root / "drafts" / name / "model.safetensors").exists():
        return
    r = CliRunner().invoke(train_cli, ["run", "--hidden", hidden.ref, "--model", str(target), "--name", name,
                                       "--order", "shards", *args])
    assert r.exit_code == 0, r.output


def assert_same_training(root: Path, name: str, atol: float, offline: str = "offline", records: int = 10) -> None:
    a, b = train_log(root, offline), train_log(root, name)
    assert [x["step"] for x in a] == [x["step"] for x in b] and len(a) >= records
    for x, y in zip(a, b):
        for k in ("loss", "val_loss"):
            if k in x:
                assert abs(x[k] - y[k]) < 1e-4, (x, y)
    a, b = weights(root, offline), weights(root, name)
    assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0) for k in a)


def test_a_budget_named_in_a_refusal_reads_back_as_at_least_the_bytes_it_names():
    """The budget a deadlock line tells the user to give, typed back into --disk-budget, is never below the
    bytes the line computed (three digits, rounded up), and both spellings come from one owner."""
    for n in (1, 999, 1000, 1001, 313_001, 1_640_000, 1_249_999_999, 7.5e11, 3.2e12):
        text = size_text(n)
        assert parse_size(text) >= n and parse_size(text) <= n * 1.01 + 1, (n, text)
    assert size_text(1_640_000) == "1.64M" and size_text(313_001) == "314K" and parse_size("1.5GB") == 1_500_000_000
    assert parse_size("5GiB") == 5 * 2**30 and parse_size("2ki") == 2048 and parse_size("1.5 MiB") == 1_572_864
    with pytest.raises(ValueError, match="not a size: expected e.g. 50G"):
        parse_size("lots")


def test_a_shard_committed_while_the_budget_is_weighed_still_counts(tmp_path, monkeypatch):
    """The extract's writer thread renames a shard's temp onto its final name while the main thread weighs the
    next shard: listed as the temp, gone by its stat, the shard still counts (before, it counted 0 bytes and one
    shard too many went under the budget)."""
    ds = Dataset.parse("racing", "hidden", tmp_path)
    ds.path.mkdir(parents=True)
    (ds.path / "shard-00000.safetensors").write_bytes(b"x" * 300)
    temp = ds.path / ".shard-00001.safetensors.tmp-77"
    temp.write_bytes(b"y" * 500)
    (ds.path / "manifest.json").write_text("{}")
    listing = Path.iterdir

    def committed_after_listing(self: Path):
        names = list(listing(self))
        if self == ds.path and temp.exists():
            temp.rename(ds.path / "shard-00001.safetensors")
        return iter(names)

    monkeypatch.setattr(Path, "iterdir", committed_after_listing)
    assert shard_bytes(ds) == 800
    assert shard_bytes(ds) == 800  # and once renamed, counted once


def test_extract_under_a_budget_with_no_consumer_stops_naming_its_last_error(tmp_path):
    """A consuming training run holds the consumer lock while it runs and records the error it stops with. The
    extract waiting under --disk-budget for room then says no run holds the lock, and after --consumer-grace
    stops with [NO_CONSUMER], naming the dataset and that error (before, it waited for ever)."""
    ds = Dataset.parse("starved", "hidden", tmp_path)
    ds.path.mkdir(parents=True)
    (ds.path / "shard-00000.safetensors").write_bytes(b"x" * 300)
    manifest: dict[str, Any] = {"status": "partial", "files": [], "params": {"num_shards": 0}}
    ds.write_manifest(manifest)
    with pytest.raises(DatasetError):
        with consumer_lock(ds, by="drafts/starved"):
            assert consumer_alive(ds)["stage"].endswith("(drafts/starved)")
            raise DatasetError("the two would wait for ever", code="STREAM_DEADLOCK", names=ds.ref)
    assert consumer_alive(ds) is None and consumer_error(ds)["by"] == "drafts/starved"
    said: list[str] = []
    with pytest.raises(DatasetError) as refusal:
        wait_for_budget(ds, manifest, 400, 1, 300, poll_s=0.01, say=said.append, grace_s=0.3)
    assert_refused(refusal.value, "NO_CONSUMER", ds.ref)
    assert "[STREAM_DEADLOCK]" in refusal.value.line and "[STREAM_DEADLOCK]" in said[0]
    assert "budget_wait" not in ds.read_manifest()  # the wait it marked is cleared as it stops
    with consumer_lock(ds, by="drafts/starved"):  # a new run clears the old error
        assert consumer_error(ds) is None


@pytest.mark.slow  # training processes killed and rerun: not in `make test-fast`
def test_followed_training_killed_and_rerun_equals_offline_shard_order(data, fixture_target, monkeypatch, tmp_path):
    root, hidden = data
    monkeypatch.setenv("EYAS_DATA", str(root))
    train_offline(root, hidden, fixture_target)
    names = shard_names(hidden)
    assert len(names) == 8

    live = LiveHidden(root, hidden, "live")
    live.add(names[0])
    # nobody writes it: the follow stops after the grace a rerun's writer has to start, in one line
    monkeypatch.setattr(eyas_common.lock, "WRITER_GRACE_S", 0.5)
    r = CliRunner().invoke(train_cli, ["run", "--hidden", "live", "--model", str(fixture_target), "--name", "early",
                                       "--follow", "--poll-seconds", "0.05", *ARGS])
    assert r.exit_code != 0 and "hidden/live stopped partial (no eyas-extract run is writing it) after 1 shards" \
        in r.output, r.output

    live.start_writer()
    log = tmp_path / "follow.log"
    proc = follow_cli(root, fixture_target, "live", "streamed", log)
    ckpts = root / "drafts" / "streamed" / "checkpoints"
    wait_for("a waiting line", lambda: "waiting for hidden/live: 1 shards final" in log.read_text(), proc, log)
    assert not ckpts.exists() or not list(ckpts.glob("step-*.pt")), "trained before its first window was final"
    live.add(*names[1:4])  # windows 0 and 1: the first pass's first batches, then a wait for shard 5
    wait_for("a checkpoint at step 2", lambda: (ckpts / "step-00000002.pt").exists(), proc, log)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert Dataset.parse("streamed", "drafts", root).read_manifest()["status"] == "partial"

    live.add(*names[4:6])
    live.complete()
    rerun = follow_cli(root, fixture_target, "live", "streamed", log)
    assert rerun.wait(timeout=600) == 0, log.read_text()
    assert "resuming at step" in log.read_text()

    assert_same_training(root, "streamed", atol=1e-5)
    m = Dataset.parse("streamed", "drafts", root).read_manifest()
    assert m["status"] == "complete" and m["params"]["config"]["order"] == "shards"
    assert m["inputs"][0]["ref"] == "hidden/live"
    assert m["inputs"][0]["manifest_sha256"] == sha256_file(live.ds.manifest_path)  # as it ended: complete


@pytest.mark.slow  # torchrun over a followed dataset
def test_followed_training_on_two_processes_equals_one_offline(data, fixture_target, monkeypatch, tmp_path):
    """Every rank waits for the same shards and deals the same window: the global batch is the offline one."""
    root, hidden = data
    monkeypatch.setenv("EYAS_DATA", str(root))
    train_offline(root, hidden, fixture_target)
    names = shard_names(hidden)
    live = LiveHidden(root, hidden, "live_two")
    live.start_writer()
    live.add(names[0])
    log = tmp_path / "two.log"
    proc = follow_cli(root, fixture_target, "live_two", "streamed_two", log, procs=2)
    wait_for("a waiting line", lambda: "waiting for hidden/live_two: 1 shards final" in log.read_text(), proc, log)
    live.add(*names[1:4])
    wait_for("a checkpoint at step 2", lambda: (root / "drafts/streamed_two/checkpoints/step-00000002.pt").exists(),
             proc, log)
    live.add(*names[4:])
    live.complete()
    assert proc.wait(timeout=600) == 0, log.read_text()
    m = Dataset.parse("streamed_two", "drafts", root).read_manifest()
    assert m["params"]["world"] == 2 and m["status"] == "complete"
    # two ranks sum the gradient in another order; Adam scales near-zero gradients up, so fc moves ~5e-5 (one
    # step of lr 3e-3 on another batch would move it ~3e-3)
    assert_same_training(root, "streamed_two", atol=1e-4)


def consuming(data: tuple[Path, Dataset], target: Path, monkeypatch, name: str) -> tuple[Path, list[str], LiveHidden]:
    """(root, shard names, hidden/NAME listed as extract lists it, its writer held), with drafts/offline1, the
    one-pass offline draft a consuming run must equal."""
    root, hidden = data
    monkeypatch.setenv("EYAS_DATA", str(root))
    train_offline(root, hidden, target, "offline1", ONE_PASS)
    live = LiveHidden(root, hidden, name)
    live.start_writer()
    return root, shard_names(hidden), live


@pytest.mark.slow
def test_consuming_one_pass_deletes_each_shard_after_its_last_use_through_a_kill(data, fixture_target, monkeypatch,
                                                                                  tmp_path):
    root, names, live = consuming(data, fixture_target, monkeypatch, "eaten")
    live.add(*names[:4])
    log = tmp_path / "consume.log"
    proc = follow_cli(root, fixture_target, "eaten", "eater", log, "--consume", *ONE_PASS)
    ckpts = root / "drafts" / "eater" / "checkpoints"
    wait_for("a checkpoint at step 2", lambda: (ckpts / "step-00000002.pt").exists(), proc, log)
    wait_for("a consumed shard", lambda: any(e.get("consumed") for e in live.ds.read_manifest()["files"]), proc, log)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    gone = [e["name"] for e in live.ds.read_manifest()["files"] if e.get("consumed")]
    assert gone and all(not (live.ds.path / n).exists() for n in gone), gone
    assert all(e.get("consumed", {}).get("by") in (None, "drafts/eater") for e in live.ds.read_manifest()["files"])

    live.add(*names[4:])
    live.complete()  # extract's last write keeps the consumed marks; the rerun counts those shards, unread
    proc = follow_cli(root, fixture_target, "eaten", "eater", log, "--consume", *ONE_PASS)
    assert proc.wait(timeout=600) == 0, log.read_text()

    a, b = train_log(root, "offline1"), train_log(root, "eater")
    assert [x["step"] for x in a] == [x["step"] for x in b]
    assert all(abs(x[k] - y[k]) < 1e-4 for x, y in zip(a, b) for k in ("loss", "val_loss") if k in x)
    wa, wb = weights(root, "offline1"), weights(root, "eater")
    assert all(torch.allclose(wa[k].float(), wb[k].float(), atol=1e-5, rtol=0) for k in wa)
    m = live.ds.read_manifest()
    assert m["status"] == "complete"
    assert {e["name"] for e in m["files"] if e.get("consumed")} == set(names)
    assert not list(live.ds.path.glob("shard-*"))
    # another draft may not read it: one line naming the consumer
    r = CliRunner().invoke(train_cli, ["run", "--hidden", "eaten", "--model", str(fixture_target), "--name", "other",
                                       "--order", "shards", *ONE_PASS])
    assert r.exit_code != 0 and "hidden/eaten was consumed by drafts/eater" in r.output, r.output


@pytest.mark.slow  # a consuming run SIGKILLed three times, then finished
def test_consuming_training_killed_at_random_moments_equals_offline(data, fixture_target, monkeypatch, tmp_path,
                                                                    reap):
    """Killed at any moment: three SIGKILLs at moments drawn from a seed (in every failure message; set
    EYAS_KILL_SEED to replay it) while shards arrive. After each, every consumed shard's last use is in a
    checkpoint (none deleted before its last use); the finished draft is the offline one, log line for log line
    and weight for weight (no shard trained on twice or skipped)."""
    seed = int(os.environ.get("EYAS_KILL_SEED") or time.time_ns() % 100_000)
    rng, moments = random.Random(seed), []
    root, names, live = consuming(data, fixture_target, monkeypatch, "shot")
    log, ckpts = tmp_path / "shot.log", root / "drafts" / "shot" / "checkpoints"
    for k in range(3):  # two more shards each time: the run never runs out of work to be killed in
        live.add(*names[2 * k:2 * k + 2])
        proc = reap(follow_cli(root, fixture_target, "shot", "shot", log, "--consume", *ONE_PASS))
        moments.append(round(rng.uniform(0.5, 8.0), 2))
        time.sleep(moments[-1])
        assert proc.poll() is None, f"seed {seed}, kills at {moments} s: it ended first:\n{log.read_text()}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        newest = max((int(p.stem.removeprefix("step-")) for p in ckpts.glob("step-*.pt")), default=0)
        marks = consumed_marks(live.ds.read_manifest())
        assert all(m["step"] <= newest and not (live.ds.path / n).exists() for n, m in marks.items()), \
            (f"seed {seed}, kills at {moments} s", marks, newest)
    live.add(*names[6:])
    live.complete()
    proc = reap(follow_cli(root, fixture_target, "shot", "shot", log, "--consume", *ONE_PASS))
    assert proc.wait(timeout=600) == 0, f"seed {seed}, kills at {moments} s:\n{log.read_text()}"
    try:
        assert_same_training(root, "shot", atol=1e-5, offline="offline1", records=6)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}, kills at {moments} s: {e}") from None


def extract_follow(root: Path, target: Path, synth: str, name: str, log: Path, budget: str) -> subprocess.Popen:
    env = {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "eyas_extract.cli", "run", "--synth", synth, "--model", str(target), "--name", name,
           "--follow", "--poll-seconds", "0.05", "--shard-samples", "3", "--disk-budget", budget]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture
def reap():
    """`reap(proc)`: a process this test starts, killed with its group if the test ends before it does."""
    procs: list[subprocess.Popen] = []
    yield lambda proc: procs.append(proc) or proc
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def refused(proc: subprocess.Popen, log: Path) -> str:
    """The one line a refused training run ends with (exit 1, no traceback)."""
    assert proc.wait(timeout=300) == 1, log.read_text()
    out = log.read_text()
    errors = [line for line in out.splitlines() if line.startswith("Error: ")]
    assert "Traceback" not in out and len(errors) == 1, out
    assert_refused(errors[0], "STREAM_DEADLOCK", "hidden/")
    return errors[0]


@pytest.mark.slow  # three extract and three training processes, one offline training
def test_disk_budget_too_small_for_training_stops_in_one_line_its_fix_resumes(
        data, fixture_target, monkeypatch, tmp_path, reap):
    """extract --follow waits for room under its budget that only train --consume frees, while train waits for
    extract's next shard: train says so in one line with the budget to give, first before its first window,
    then mid-run; extract, killed and rerun with that budget, and train, rerun, finish as the offline run."""
    root, hidden = data
    monkeypatch.setenv("EYAS_DATA", str(root))
    # 4 validation samples in the first window's 6: both its shards hold one, so training frees neither
    args = [a if ONE_PASS[i - 1] != "--val-samples" else "4" for i, a in enumerate(ONE_PASS)]
    train_offline(root, hidden, fixture_target, "offline_v4", args)
    synth = hidden.read_manifest()["inputs"][0]["ref"]
    size = [e["bytes"] for e in sorted(hidden.read_manifest()["files"], key=lambda e: e["name"])
            if e["name"].startswith("shard-")]
    ext_log, log = tmp_path / "extract.log", tmp_path / "train.log"

    # room for shard 0 alone: the first window (shards 0 and 1) never comes
    ext = reap(extract_follow(root, fixture_target, synth, "tight", ext_log, str(size[0] + size[1] - 1)))
    line = refused(reap(follow_cli(root, fixture_target, "tight", "tight", log, "--consume", *args)), log)
    assert "--disk-budget" in line and "--window-shards" in line, line  # the options that fix it
    assert ext.poll() is None and "waiting for training to consume shards" in ext_log.read_text()
    os.killpg(ext.pid, signal.SIGKILL)  # leaves its wait marked in the manifest: the rerun must not trust it
    ext.wait()

    # room for the first window: training takes it, then needs shard 3 and can free neither shard it holds
    # (training starts before extract has taken the writer lock again: it waits for it, as after any rerun)
    ext = reap(extract_follow(root, fixture_target, synth, "tight", ext_log, str(sum(size[:3]) - 1)))
    line = refused(reap(follow_cli(root, fixture_target, "tight", "tight", log, "--consume", *args)), log)
    budget = re.search(r"--disk-budget (\S+) or more", line).group(1)  # the size that works, tested below
    # a recipe of two passes frees nothing before its end: no budget under the whole dataset holds it
    twice = [a if ARGS[i - 1] != "--val-samples" else "4" for i, a in enumerate(ARGS)]
    line = refused(reap(follow_cli(root, fixture_target, "tight", "twice", log, "--consume", *twice)), log)
    assert "--epochs 1" in line, line  # no budget under the whole dataset: one pass is the fix
    os.killpg(ext.pid, signal.SIGINT)
    assert ext.wait(timeout=60) != 0

    # the budget the line names: both run to the end, and the draft is the offline draft
    with PeakBytes(root / "hidden" / "tight") as peak:
        ext = reap(extract_follow(root, fixture_target, synth, "tight", ext_log, budget))
        proc = reap(follow_cli(root, fixture_target, "tight", "tight", log, "--consume", *args))
        assert proc.wait(timeout=600) == 0, log.read_text()
        assert ext.wait(timeout=120) == 0, ext_log.read_text()
    m = Dataset.parse("tight", "hidden", root).read_manifest()
    assert m["status"] == "complete" and "budget_wait" not in m
    assert all(e.get("consumed", {}).get("by") == "drafts/tight" for e in m["files"] if e["name"].startswith("shard-"))
    assert 0 < peak.peak <= parse_size(budget), (peak.peak, budget)
    assert_same_training(root, "tight", atol=1e-5, offline="offline_v4", records=6)  # 5 steps, a validation


@pytest.mark.slow  # an extract and a training process
def test_a_training_run_that_ends_before_the_data_ends_extract_under_a_budget(data, fixture_target, tmp_path, reap):
    """A consuming run whose schedule ends before the data (as an early stop does) frees every shard it listed,
    and extract, waiting under its budget for room nobody would free again, stops in one line, exit 0."""
    root, hidden = data
    size = [e["bytes"] for e in sorted(hidden.read_manifest()["files"], key=lambda e: e["name"])
            if e["name"].startswith("shard-")]
    # 2 of the 5 steps a pass takes, over shards 0-3: extract makes 0-6 as training frees them and stops before 7
    args = [a if ONE_PASS[i - 1] not in ("--val-samples", "--epochs") else {"--epochs": "0.4"}.get(ONE_PASS[i - 1], "4")
            for i, a in enumerate(ONE_PASS)]
    ext_log, log = tmp_path / "extract.log", tmp_path / "train.log"
    ext = reap(extract_follow(root, fixture_target, hidden.read_manifest()["inputs"][0]["ref"], "short", ext_log,
                              str(size[0] + size[1] + size[4] + size[5] + size[6])))
    proc = reap(follow_cli(root, fixture_target, "short", "short", log, "--consume", *args))
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert ext.wait(timeout=120) == 0, ext_log.read_text()
    line = ext_log.read_text().splitlines()[-1]
    assert "hidden/short: stopping before shard-" in line and "drafts/short, the training run that consumes it, is " \
        "complete" in line, ext_log.read_text()
    m = Dataset.parse("short", "hidden", root).read_manifest()
    assert m["status"] == "partial" and "budget_wait" not in m
    assert all(e.get("consumed", {}).get("by") == "drafts/short" for e in m["files"] if e["name"].startswith("shard-"))
    assert not list((root / "hidden" / "short").glob("shard-*")) and len(m["files"]) < len(size)
    assert Dataset.parse("short", "drafts", root).read_manifest()["status"] == "complete"


@pytest.mark.slow
def test_make_pipeline_streams_synth_extract_and_train_at_once_under_a_disk_budget(fixture_target, tmp_path):
    root = tmp_path / "data"
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 48, seed=3)
    budget = 1_500_000  # about 7 of the 16 shards
    # --ckpt-every stays at its default (200 > the 12 steps): shards are freed when past their last use, not at
    # a checkpoint step, or extract would wait on the budget for shards train holds while train waits on extract
    # a slow server (one answer at a time, 0.25 s each), so that extract and train start before synth ends
    with PeakBytes(root / "hidden" / "pipe") as peak, \
            start_stub(answer=rendering_answer(load_tokenizer(fixture_target)), latency_s=0.25) as stub:
        r = make("pipeline", N="48", PROMPTS=str(prompts), SERVER=stub.url, MODEL=str(fixture_target), NAME="pipe",
                 EYAS_DATA=str(root), CONCURRENCY="1", MAX_TOKENS="40", TEMPERATURE="0", SYNTH_ARGS="--seed 0",
                 DISK_BUDGET=str(budget), EXTRACT_ARGS="--shard-samples 3 --poll-seconds 0.05",
                 TRAIN_ARGS="--draft-vocab 512 --ttt-steps 2 --batch-size 4 --epochs 1 --val-samples 2 "
                            "--window-shards 2 --poll-seconds 0.05 --patience 0")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    for ref in ("synth/pipe", "hidden/pipe", "drafts/pipe"):
        kind, name = ref.split("/")
        assert Dataset.parse(name, kind, root).read_manifest()["status"] == "complete", ref
    # each follower waited for the stage before it: the three ran at once
    assert "waiting for synth/pipe" in out and "waiting for hidden/pipe" in out, out[-5000:]
    m = Dataset.parse("pipe", "drafts", root).read_manifest()
    assert [i["ref"] for i in m["inputs"]] == ["hidden/pipe", "synth/pipe"]
    hm = Dataset.parse("pipe", "hidden", root).read_manifest()
    total = sum(e["bytes"] for e in hm["files"] if e["name"].startswith("shard-"))
    marks = [e.get("consumed", {}).get("by") for e in hm["files"] if e["name"].startswith("shard-")]
    # all 11 steps run (--patience 0: an early stop would end extract's wait under the budget before the last
    # shards, leaving hidden/pipe partial), so every shard was used, then consumed
    assert all(by == "drafts/pipe" for by in marks), marks
    assert total > budget and 0 < peak.peak <= budget, (peak.peak, budget, total)


def test_make_pipeline_ends_when_one_stage_fails(fixture_target, tmp_path):
    """A stage that fails (train, here on an option it does not know) ends `make pipeline` with its exit status,
    and synth and extract, which would wait on a slow server for minutes, are stopped at once."""
    root = tmp_path / "data"
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 48, seed=3)
    with start_stub(answer=rendering_answer(load_tokenizer(fixture_target)), latency_s=0.5) as stub:
        t0 = time.monotonic()
        r = make("pipeline", N="48", PROMPTS=str(prompts), SERVER=stub.url, MODEL=str(fixture_target), NAME="halt",
                 EYAS_DATA=str(root), CONCURRENCY="1", MAX_TOKENS="40", TRAIN_ARGS="--no-such-option")
    assert r.returncode == 2, r.stdout + r.stderr  # click's usage error, passed on
    assert "--no-such-option" in r.stderr and "make pipeline: a stage failed (exit 2)" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 24, "synth ran on: 48 answers at 0.5 s each take 24 s"
    left = subprocess.run(["pgrep", "-f", "--name halt"], capture_output=True, text=True).stdout.split()
    assert not left, f"stages still running: {left}"
