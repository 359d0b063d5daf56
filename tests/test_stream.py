"""Streaming, step 1 (issue 20): `eyas-extract run --follow` on a synth dataset still being written.

The test writes the synth dataset itself, as eyas-synth does (partial manifest, writer lock held, answers
appended out of id order, a torn last line, rejected and set-aside ids), and checks that the followed
extraction equals an offline one of the finished dataset byte for byte, through a SIGKILL too, and that a
synth run that stopped partial ends the follow with one line."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import eyas_common.lock
from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.contract import Dataset, DatasetError, JsonlTail, finalize, new_manifest
from eyas_common.hidden import open_hidden
from eyas_common.lock import WriterLock, holder
from eyas_common.samples import FAILURES, REJECTED, SAMPLES, TRUNCATED, SampleLine, SynthTail
from eyas_extract.batching import plan_shards
from eyas_extract.cli import main as extract_cli
from eyas_extract.follow import ShardCutter
from eyas_extract.run import run as extract
from eyas_testing.datasets import make_synth
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.stub import start_stub
from helpers import refuses, rendering_answer

N = 12
SMALL = {"shard_samples": 3, "batch_tokens": 160}


# Tiny matmuls on a shared 2-core machine: one thread is many times faster than two fighting.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory, fixture_target) -> Path:
    root = tmp_path_factory.mktemp("stream")
    make_synth(root, fixture_target, n=N)
    return root


@pytest.fixture(scope="module")
def answers(root) -> dict[int, dict[str, Any]]:
    """The fixture's answers by id, to append as a synth run would."""
    lines = (root / "synth" / "fx" / SAMPLES).read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


class LiveSynth:
    """A synth dataset written the way eyas-synth writes it: partial manifest, writer lock held, answers
    appended as they come; `complete` marks it complete and releases the lock, as a finished run does."""

    def __init__(self, root: Path, target: Path, name: str, answers: dict[int, dict[str, Any]]):
        self.ds, self.answers = Dataset.parse(name, "synth", root), answers
        self.ds.path.mkdir(parents=True)
        self.lock = WriterLock(self.ds, stage="01_synth").acquire()
        fingerprint = target_fingerprint(load_tokenizer(target), target)
        self.manifest = new_manifest("synth", stage="01_synth", target=fingerprint, inputs=[], params={"n": N})
        self.ds.write_manifest(self.manifest)

    def append(self, name: str, records: list[dict[str, Any]], torn: bytes = b"") -> None:
        with open(self.ds.path / name, "ab") as f:
            f.write(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records) + torn)

    def keep(self, *ids: int) -> None:
        self.append(SAMPLES, [self.answers[i] for i in ids])

    def complete(self) -> None:
        counts = {name: len((self.ds.path / name).read_text().splitlines())
                  for name in (SAMPLES, TRUNCATED, REJECTED) if (self.ds.path / name).exists()}
        finalize(self.ds, self.manifest, stats={"samples": counts[SAMPLES], "missing": []}, records=counts)
        self.lock.release()


def shard_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("shard-*.safetensors"))}


def manifest(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / "hidden" / name / "manifest.json").read_text())


def listed(root: Path, name: str) -> list[str]:
    path = root / "hidden" / name / "manifest.json"
    return [f["name"] for f in manifest(root, name)["files"]] if path.exists() else []


def follow_cli(root: Path, target: Path, synth: str, name: str, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "eyas_extract.cli", "run", "--synth", synth, "--model", str(target), "--name", name,
           "--follow", "--poll-seconds", "0.05", "--batch-tokens", "160", "--quiet", *extra]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_until(what: str, done: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"extract ended (exit {proc.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{log.read_text()}"
        time.sleep(0.01)


def assert_same_as_offline(root: Path, target: Path, synth: str, followed: str, offline: str, **opts: Any) -> None:
    """The followed dataset equals an offline extraction of the finished synth dataset: same shard bytes, same
    files listed, same params; and training opens it."""
    extract(synth=synth, model=target, name=offline, data_root=root, progress=False, batch_tokens=160, **opts)
    assert shard_hashes(root / "hidden" / followed) == shard_hashes(root / "hidden" / offline)
    a, b = manifest(root, followed), manifest(root, offline)
    assert a["status"] == b["status"] == "complete"
    assert [f["name"] for f in a["files"]] == [f["name"] for f in b["files"]]
    assert [f["sha256"] for f in a["files"] if f["name"].startswith("shard-")] == \
        [f["sha256"] for f in b["files"] if f["name"].startswith("shard-")]
    assert a["params"] == b["params"] and a["inputs"] == b["inputs"]
    assert open_hidden(f"hidden/{followed}", data_root=root).manifest["stats"]["samples"] == b["stats"]["samples"]


# ------------------------------------------------------------------------------------------------
# the pieces: reading a file being appended, deciding ids, cutting final shards


def test_tail_reads_complete_lines_only(tmp_path):
    path = tmp_path / "x.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == []  # not there yet
    path.write_bytes(b'{"id":1}\n{"id":2')
    assert [r for _, _, r in tail.read_new()] == [{"id": 1}]
    assert tail.read_new() == []  # the torn line is not a record yet
    with open(path, "ab") as f:
        f.write(b'}\n\n{"id":3}\n')
    assert [(n, pos, r) for n, pos, r in tail.read_new()] == [(2, 9, {"id": 2}), (4, 19, {"id": 3})]
    with open(path, "ab") as f:
        f.write(b'{"id":\n')
    with refuses("MALFORMED_JSONL", "x.jsonl:5"):
        tail.read_new()
    path.write_bytes(b"")
    with pytest.raises(DatasetError, match="shrank below"):
        tail.read_new()


@pytest.mark.parametrize("seed", range(5))
def test_cutter_over_any_arrival_order_equals_the_offline_plan(seed):
    """Samples arriving in any order and chunking, some ids rejected: the shards cut as they become final are
    exactly plan_shards over the finished set, token cuts included."""
    rng = random.Random(seed)
    refs = [SampleLine(i, rng.randint(1, 40), 1, 0) for i in range(60)]
    kept = [r for r in refs if rng.random() > 0.2]
    by_id = {r.id: r for r in kept}
    decided: set[int] = set()
    cutter, prefix, shards = ShardCutter(shard_samples=4, shard_tokens=70), 0, []
    order = [r.id for r in refs]
    rng.shuffle(order)
    while order:
        k = rng.randint(1, 7)
        decided |= set(order[:k])
        order = order[k:]
        ready = []
        while prefix in decided:
            if prefix in by_id:
                ready.append(by_id[prefix])
            prefix += 1
        shards += cutter.cut(ready, complete=not order)
    assert shards == plan_shards(kept, 4, 70)


def test_synth_tail_decides_kept_set_aside_and_rejected_ids(root, fixture_target, answers):
    live = LiveSynth(root, fixture_target, "tail", answers)
    tail = SynthTail(live.ds, vocab_size=10**6)
    tail.poll()
    assert tail.writer is not None and tail.writer["pid"] == os.getpid() and not tail.complete
    live.keep(1, 0)
    live.append(REJECTED, [{"id": 3, "problems": ["x"], "sample": answers[3]}])
    live.append(FAILURES, [{"id": 2, "attempts": 8, "error": "timeout"}])  # retried by synth: not decided
    live.append(TRUNCATED, [answers[4]])
    tail.poll()
    assert [r.id for r in tail.take_ready()] == [0, 1] and tail.prefix == 2 and tail.n_decided == 4
    live.keep(2)
    tail.poll()
    assert [r.id for r in tail.take_ready()] == [2] and tail.prefix == 5  # 3 rejected, 4 set aside
    live.keep(7, 2)
    with refuses("BAD_SAMPLE", "samples.jsonl:5"):
        tail.poll()
    live.lock.release()
    assert holder(live.ds) is None


# ------------------------------------------------------------------------------------------------
# following a live synth dataset, byte for byte an offline extraction


@pytest.mark.slow  # two extract processes and an offline run: about a minute on 2 cores
def test_follow_equals_offline_extraction(root, fixture_target, answers, tmp_path):
    live = LiveSynth(root, fixture_target, "live", answers)
    # arrived: 1, 0, 4 and half of 2's line (being written): ids 0, 1 are settled, 2 is not yet
    line2 = json.dumps(answers[2], separators=(",", ":")).encode() + b"\n"
    live.append(SAMPLES, [answers[1], answers[0], answers[4]], torn=line2[:40])
    log = tmp_path / "follow.log"
    proc = follow_cli(root, fixture_target, "synth/live", "followed", log, "--shard-samples", "3")
    wait_until("the waiting line", lambda: "waiting for synth/live" in log.read_text(), proc, log)
    assert ("waiting for synth/live: 3 of 12 ids decided (3 samples), 0 shards extracted; the next shard waits "
            "for id 2") in log.read_text()
    assert manifest(root, "followed")["status"] == "partial" and listed(root, "followed") == []
    # 2 is written out, 3 kept, 5 rejected: shard 0 = [0, 1, 2] is final; [3, 4] waits for 6
    with open(live.ds.path / SAMPLES, "ab") as f:
        f.write(line2[40:])
    live.keep(3)
    live.append(REJECTED, [{"id": 5, "problems": ["test"], "sample": answers[5]}])
    wait_until("shard 0 listed", lambda: listed(root, "followed") == ["shard-00000.safetensors"], proc, log)
    entry = manifest(root, "followed")["files"][0]
    assert (entry["records"], entry["first_id"], entry["last_id"]) == (3, 0, 2)
    # every id decided (8 set aside), out of order; the last shard [11] waits for synth to end
    live.keep(7, 6, 10, 9)
    live.append(TRUNCATED, [answers[8]])
    live.keep(11)
    wait_until("3 shards listed", lambda: len(listed(root, "followed")) == 3, proc, log)
    assert not (root / "hidden" / "followed" / "shard-00003.safetensors").exists()
    assert manifest(root, "followed")["params"]["num_shards"] == 0
    live.complete()
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert "hidden/followed complete: 10 samples" in log.read_text()
    assert_same_as_offline(root, fixture_target, "synth/live", "followed", "offline", shard_samples=3)


@pytest.mark.slow  # extract killed and rerun, then an offline run
def test_sigkill_mid_follow_then_rerun_gives_the_same_result(root, fixture_target, answers, tmp_path):
    live = LiveSynth(root, fixture_target, "killsrc", answers)
    live.keep(*range(N))  # all there, synth still running: 12 final one-sample shards
    log = tmp_path / "kill.log"
    out = root / "hidden" / "killed"
    args = ("--shard-samples", "1")
    proc = follow_cli(root, fixture_target, "synth/killsrc", "killed", log, *args)
    wait_until("a first shard", lambda: any(out.glob("shard-*.safetensors")), proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    on_disk = sorted(p.name for p in out.glob("shard-*.safetensors"))
    assert 0 < len(on_disk) < N, f"the kill should land mid-run ({len(on_disk)} of {N} shards)"
    m = manifest(root, "killed")
    assert m["status"] == "partial"
    # what is listed is there, as listed; a shard renamed but not yet listed is listed by the rerun
    assert set(listed(root, "killed")) <= set(on_disk)
    assert all((out / f["name"]).stat().st_size == f["bytes"] for f in m["files"])

    (out / ".manifest.json.tmp-999999").write_text('{"sta')  # what a kill mid-write of the manifest leaves
    proc = follow_cli(root, fixture_target, "synth/killsrc", "killed", log, *args)
    wait_until("every shard listed", lambda: len(listed(root, "killed")) == N, proc, log)
    text = log.read_text()
    assert f"{len(on_disk)} of {N} shards already there ({N} final so far), {N - len(on_disk)} to extract" in text
    assert "taking over the writer lock" in text
    live.complete()
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    assert_same_as_offline(root, fixture_target, "synth/killsrc", "killed", "unkilled", shard_samples=1)


@pytest.mark.slow  # a real eyas-synth process, an extract process and an offline run
def test_follow_a_real_synth_run(root, fixture_target, tmp_path):
    """eyas-synth against the stub, its answers held back after the first 20 until the followed extraction has
    listed a shard: the shards are made while synth runs, and equal an offline run's."""
    tok = load_tokenizer(fixture_target)
    answer, gate = rendering_answer(tok), threading.Event()

    def held(payload: dict[str, Any]) -> dict[str, Any]:
        if payload["seed"] >= 20:  # seed = id with --seed 0; this stalls the stub, and synth with it
            gate.wait(300)
        return answer(payload)

    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 8, seed=2)
    log, synth_log = tmp_path / "follow.log", tmp_path / "synth.log"
    sds = Dataset.parse("real", "synth", root)
    env = {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1"}
    with start_stub(answer=held) as stub:
        synth = subprocess.Popen([sys.executable, "-m", "eyas_synth.cli", "run", "--quiet", "--prompts", str(prompts),
                                  "--name", "real", "--model", str(fixture_target), "--server", stub.url, "--n", "30",
                                  "--served-model", "fixture", "--seed", "0", "--concurrency", "2"],
                                 env=env, stdout=open(synth_log, "w"), stderr=subprocess.STDOUT)
        wait_until("synth's manifest", sds.exists, synth, synth_log)
        proc = follow_cli(root, fixture_target, "synth/real", "realfollow", log, "--shard-samples", "3")
        try:
            wait_until("a shard listed", lambda: bool(listed(root, "realfollow")), proc, log)
            assert sds.read_manifest()["status"] == "partial" and synth.poll() is None
        finally:
            gate.set()
        assert synth.wait(timeout=300) == 0, synth_log.read_text()
        assert proc.wait(timeout=300) == 0, log.read_text()
    assert_same_as_offline(root, fixture_target, "synth/real", "realfollow", "realoffline", shard_samples=3)


def test_synth_stopped_partial_is_one_line_then_resume(root, fixture_target, answers, monkeypatch):
    monkeypatch.setattr(eyas_common.lock, "WRITER_GRACE_S", 0.5)  # what a rerun's writer has to start in
    live = LiveSynth(root, fixture_target, "stopped", answers)
    live.keep(0, 1, 3, 2, 5)
    live.append(FAILURES, [{"id": 4, "attempts": 8, "error": "timeout"}])
    live.lock.release()  # synth ended partial (or died): nobody is writing it
    args = ["run", "--synth", "synth/stopped", "--model", str(fixture_target), "--name", "halted", "--follow",
            "--shard-samples", "2", "--batch-tokens", "160", "--quiet"]
    r = CliRunner().invoke(extract_cli, args, env={"EYAS_DATA": str(root)})
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert r.stderr.count("Error:") == 1 and last.startswith(
        "Error: synth/stopped stopped partial (no eyas-synth run is writing it): ids below 4 are decided and their "
        "2 shards are in hidden/halted; resume it with the same eyas-synth command"), r.stderr
    assert listed(root, "halted") == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert manifest(root, "halted")["status"] == "partial"
    other = [*args[:6], "halted2", *args[7:]]
    assert CliRunner().invoke(extract_cli, other, env={"EYAS_DATA": str(root)}).exit_code == 1
    # synth resumed and completed; the same command finishes the extraction, and so does one without --follow
    live.lock.acquire()
    live.keep(4, *range(6, N))
    live.complete()
    r = CliRunner().invoke(extract_cli, args, env={"EYAS_DATA": str(root)})
    assert r.exit_code == 0, r.output
    assert "2 of 6 shards already there (6 final so far), 4 to extract" in r.stderr
    r = CliRunner().invoke(extract_cli, [a for a in other if a != "--follow"], env={"EYAS_DATA": str(root)})
    assert r.exit_code == 0, r.output
    assert "2 of 6 shards already there (6 in all), 4 to extract" in r.stderr
    assert_same_as_offline(root, fixture_target, "synth/stopped", "halted", "halted_offline", shard_samples=2)
    assert shard_hashes(root / "hidden" / "halted2") == shard_hashes(root / "hidden" / "halted")
    assert manifest(root, "halted2")["params"] == manifest(root, "halted")["params"]


# ------------------------------------------------------------------------------------------------
# refusals


def test_refusals(root, fixture_target, answers, monkeypatch):
    go = dict(model=fixture_target, data_root=root, progress=False, **SMALL)
    with pytest.raises(DatasetError, match=r"^--follow runs as one worker.*: run it without --shard 0/2$"):
        extract(synth="synth/fx", name="x", follow=True, shard="0/2", **go)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(DatasetError, match=r"run it without torchrun \(2 ranks\)"):
        extract(synth="synth/fx", name="x", follow=True, **go)
    monkeypatch.undo()
    live = LiveSynth(root, fixture_target, "growing", answers)
    live.keep(0, 1)
    try:  # without --follow a partial input is refused as before
        with refuses("PARTIAL", "synth/growing"):
            extract(synth="synth/growing", name="x", **go)
    finally:
        live.lock.release()
    assert not (root / "hidden" / "x").exists()
