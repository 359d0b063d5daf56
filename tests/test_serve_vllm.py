"""Stage 04 against real vLLM (CPU): `eyas-serve launch` serves the session's trained draft, `eyas-serve bench`
measures it against the plain server, and its acceptance is the one the server's own counters give; vLLM's
prompt lookup is served and measured per target step; a server without a draft is reported as such; an engine that never gets healthy is stopped; Ctrl-C during a
bench leaves no server and no complete results.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from eyas_common.bench import read_results
from eyas_common.contract import Dataset
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.servers import free_port
from eyas_train.eval import evaluate

pytestmark = pytest.mark.vllm
EYAS_SERVE = str(Path(sys.executable).parent / "eyas-serve")
CPU_ENGINE = ["--", "--max-model-len", "1024", "--dtype", "float32"]


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (the launcher passes its environment to the engine)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"EYAS_TEST_MARKER={marker}".encode() in (d / "environ").read_bytes():
                    state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        pids.append(int(d.name))
            except OSError:
                pass
    return pids


def requests_running(url: str) -> float:
    """Requests the engine is working on now, from its /metrics gauge."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


@dataclass
class Launched:
    proc: subprocess.Popen
    url: str
    marker: str
    log: Path


def launch(root: Path, model: Path, log: Path, *args: str, timeout_s: float = 900) -> Launched:
    """`eyas-serve launch ...` in the background, healthy (or exited) when this returns."""
    marker, port = uuid.uuid4().hex, free_port()
    env = {**os.environ, "EYAS_DATA": str(root), "EYAS_TEST_MARKER": marker}
    proc = subprocess.Popen([EYAS_SERVE, "launch", "--model", str(model), "--port", str(port), "--log", str(log),
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = Launched(proc, f"http://127.0.0.1:{port}", marker, log)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{out.url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(1)
    return out


def bench(root: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([EYAS_SERVE, "bench", *args], capture_output=True, text=True,
                          env={**os.environ, "EYAS_DATA": str(root)}, **kw)


def spec_counts(url: str) -> tuple[float, float, list[float]]:
    """drafts, accepted and accepted per position, read straight from the server's /metrics page."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = lambda name, pos=None: sum(  # noqa: E731
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith(f"vllm:spec_decode_{name}{{") and (pos is None or f'position="{pos}"' in line))
    return total("num_drafts_total"), total("num_accepted_tokens_total"), \
        [total("num_accepted_tokens_per_pos_total", i) for i in range(3)]


def test_prompt_lookup_drafts_on_some_steps_and_tokens_per_step_counts_them_all(vllm_server, fixture_target,
                                                                                 tmp_path):
    """`eyas-serve launch --prompt-lookup` serves vLLM's n-gram speculation (no draft model). It drafts only
    where an n-gram of the request recurs, so its acceptance length (over the steps it drafted) reads above
    its tokens per target step (over every step): the figure that compares it with a trained draft. First in
    this module, before `served` starts: one engine beside the shared plain server, not two."""
    s = launch(tmp_path, fixture_target, tmp_path / "lookup.log", "--prompt-lookup", *CPU_ENGINE)
    try:
        assert s.proc.poll() is None, f"eyas-serve launch exited: {s.proc.stderr.read()}"
        prompts = write_prompts_jsonl(tmp_path / "p.jsonl", 16, seed=11)
        r = bench(tmp_path, "--server", s.url, "--baseline", vllm_server.url, "--prompts", str(prompts), "--name",
                  "lookup", "--concurrency", "4", "--warmup", "0", timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        s.proc.send_signal(signal.SIGTERM)
        err = s.proc.communicate(timeout=120)[1]
    assert s.proc.returncode == 0 and "vLLM prompt lookup: 2-4-grams, K 3, no draft model" in err, err[-2000:]
    assert not marked_pids(s.marker)
    _, _, results = read_results("bench/lookup", root=tmp_path)
    spec, level = results["spec"], results["levels"][0]
    steps = level["draft"]["output_tokens"] / spec["tokens_per_step"]  # 16 prefills, then one step per decode
    assert 0 < spec["drafts"] < steps - 16 - 1, (spec, steps)  # some decode steps carried no draft
    assert 1 < spec["tokens_per_step"] < spec["acceptance_length"], spec


@pytest.fixture(scope="module")
def served(trained_draft, fixture_target, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "draft.log"
    s = launch(trained_draft.root, fixture_target, log, "--draft", trained_draft.ref, "--spec-tokens", "3",
               *CPU_ENGINE)
    assert s.proc.poll() is None, f"eyas-serve launch exited: {s.proc.stderr.read()}"
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(120)
    assert not marked_pids(s.marker), "engine processes left behind"


def test_bench_acceptance_is_the_servers_own(served, vllm_server, trained_draft, fixture_target):
    root = trained_draft.root
    prompts = write_prompts_jsonl(root / "heldout.jsonl", 40, seed=11)  # held-out problems, not trained on
    d0, a0, p0 = spec_counts(served.url)
    r = bench(root, "--server", served.url, "--baseline", vllm_server.url, "--prompts", str(prompts),
              "--name", "trained", "--draft", trained_draft.ref, "--concurrency", "8", "--warmup", "0", timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    d1, a1, p1 = spec_counts(served.url)
    ds, manifest, results = read_results("bench/trained", root=root)
    spec = results["spec"]
    assert (spec["drafts"], spec["accepted"]) == (d1 - d0, a1 - a0)
    assert spec["acceptance_length"] == pytest.approx(1 + (a1 - a0) / (d1 - d0), abs=1e-12)
    assert spec["per_position"] == pytest.approx([(b - a) / (d1 - d0) for a, b in zip(p0, p1)], abs=1e-12)
    level = results["levels"][0]
    assert level["draft"]["requests"] == level["baseline"]["requests"] == 40 and level["draft"]["errors"] == 0
    assert level["speedup"] == pytest.approx(level["draft"]["tokens_per_s"] / level["baseline"]["tokens_per_s"])
    # the server's own step count: 40 prefills and the verified drafts (EAGLE-3 drafts after every step)
    assert spec["tokens_per_step"] == pytest.approx(level["draft"]["output_tokens"] / (spec["drafts"] + 40)), spec
    assert [i["ref"] for i in manifest["inputs"]][:3] == ["drafts/fixture_trained", "hidden/fixture_400_0",
                                                          "synth/fixture_400_0"]
    assert manifest["target"]["model"] == str(fixture_target) and (ds.path / "bench.png").stat().st_size > 0

    offline = evaluate(draft=trained_draft.ref, model=fixture_target, prompts=prompts, spec_tokens=3, data_root=root)
    print(json.dumps({"vllm": spec, "speedup_c8": level["speedup"], "offline": offline}, indent=2))
    # A quality floor, not a figure: a draft that learned nothing accepts about 1. The same 400 answers give
    # 3.2-3.4 as rounding-level changes to training move it (3.275 after the loss's arithmetic was reordered,
    # above 3.3 before; five seeds of the llama x 250 cell span 3.19-3.39), so the floor sits below that band.
    assert spec["acceptance_length"] >= 3.1, spec
    assert abs(offline["acceptance_length"] - spec["acceptance_length"]) <= 0.15, (offline, spec)
    # what `eyas-train run` predicted by replaying its validation slice as a greedy verifier is vLLM's, within 0.2
    predicted = Dataset.parse(trained_draft.ref, "drafts", root).read_manifest()["stats"]["predicted_acceptance"]["3"]
    assert abs(predicted - spec["acceptance_length"]) <= 0.2, (predicted, spec)
    report = subprocess.run([EYAS_SERVE, "report", "bench/trained"], capture_output=True, text=True,
                            env={**os.environ, "EYAS_DATA": str(root)})
    assert f"acceptance length {spec['acceptance_length']:.2f}" in report.stdout


def test_a_server_without_a_draft_is_reported_as_such(vllm_server, tmp_path):
    prompts = write_prompts_jsonl(tmp_path / "p.jsonl", 2, seed=11)
    r = bench(tmp_path, "--server", vllm_server.url, "--prompts", str(prompts), "--name", "plain",
              "--concurrency", "1", "--max-tokens", "16", "--warmup", "0", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exposes no speculative-decoding counters" in r.stderr
    _, _, results = read_results("bench/plain", root=tmp_path)
    assert results["spec"] is None and results["levels"][0]["spec"] is None
    assert "acceptance length: not reported" in r.stdout


def test_an_engine_that_never_gets_healthy_is_stopped(fixture_target, tmp_path):
    log = tmp_path / "slow.log"
    s = launch(tmp_path, fixture_target, log, "--health-timeout", "5", *CPU_ENGINE, timeout_s=120)
    s.proc.wait(120)
    err = s.proc.stderr.read()
    assert s.proc.returncode == 1 and "Traceback" not in err.split("last lines of")[0]
    assert "did not become healthy; it was stopped" in err and "not healthy after 5s" in err
    assert "vllm.entrypoints.openai.api_server" in err  # the log's tail: its first line is the command
    assert not marked_pids(s.marker)


def test_ctrl_c_during_a_bench_leaves_no_server_and_no_results(served, trained_draft):
    """Last in this module: it stops the served draft, as Ctrl-C in the terminals running both would (the
    bench gets SIGTERM, as from `docker stop`: the same exit)."""
    root = trained_draft.root
    prompts = write_prompts_jsonl(root / "heldout_ctrl_c.jsonl", 40, seed=12)
    b = subprocess.Popen([EYAS_SERVE, "bench", "--server", served.url, "--prompts", str(prompts), "--name",
                          "interrupted", "--concurrency", "1", "--num-prompts", "4000", "--warmup", "0"],
                         env={**os.environ, "EYAS_DATA": str(root)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = Dataset.parse("interrupted", "bench", root).manifest_path
    # interrupt once the server is working on one of the bench's requests (4,000 one at a time last minutes: 400
    # once ended in 35 s with no poll of the gauge catching one in flight)
    # (judged once per poll: asking the gauge again after the loop raced a request that had just ended)
    deadline, in_flight = time.monotonic() + 120, False
    while not in_flight and time.monotonic() < deadline:
        assert b.poll() is None, "the bench ended before a request was in flight: " + b.stderr.read()[-2000:]
        in_flight = manifest.exists() and requests_running(served.url) > 0
        time.sleep(0 if in_flight else 0.1)
    assert in_flight, "no request in flight after 120 s"
    b.send_signal(signal.SIGTERM)
    served.proc.send_signal(signal.SIGINT)
    err = b.communicate(timeout=120)[1]
    assert b.returncode == 130, err[-4000:]
    assert served.proc.wait(120) == 130
    assert "Traceback" not in err
    assert json.loads(manifest.read_text())["status"] == "partial"
    assert not (manifest.parent / "results.json").exists()
    assert not marked_pids(served.marker)


def test_compare_serves_each_candidate_against_the_target_alone(trained_draft, fixture_target, tmp_path):
    """`eyas-serve compare`: the target alone, prompt lookup and the trained draft, each an ordinary launch and
    bench (its own bench dataset, lineage to the draft), one table, a plot and the make line of the winner."""
    from eyas_common.bench import read_compare
    from eyas_serve.compare import recommend

    root = trained_draft.root
    prompts = write_prompts_jsonl(tmp_path / "heldout.jsonl", 8, seed=21)
    port = free_port()
    r = subprocess.run([EYAS_SERVE, "compare", "--model", str(fixture_target), "--prompts", str(prompts),
                        "--name", "cmp", "--draft", trained_draft.ref, "--concurrency", "1,4", "--max-tokens", "64",
                        "--port", str(port), "--", "--max-model-len", "1024", "--dtype", "float32", "--enforce-eager"],
                       capture_output=True, text=True, env={**os.environ, "EYAS_DATA": str(root)}, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    ds, manifest, compare = read_compare("bench/cmp", root)
    rows = {row["label"]: row for row in compare["rows"]}
    assert list(rows)[:2] == ["target alone", "prompt lookup"] and trained_draft.ref in rows
    assert [i["ref"] for i in manifest["inputs"]] == [rows[k]["bench"] for k in list(rows)[1:]]
    for label in list(rows)[1:]:  # each row is its own bench, measured against the target alone
        _, bench_manifest, results = read_results(rows[label]["bench"], root)
        assert results["baseline"] == f"http://127.0.0.1:{port}"
        assert [lv["speedup"] for lv in results["levels"]] == list(rows[label]["speedup"].values())
        assert results["spec"]["tokens_per_step"] == rows[label]["tokens_per_step"] > 1.0
    assert bench_manifest["inputs"][0]["ref"] == trained_draft.ref  # the draft's row names the draft
    assert compare["recommendation"] == recommend(compare["rows"])
    assert compare["recommendation"]["serve"] in r.stdout and (ds.path / "compare.png").read_bytes()[:4] == b"\x89PNG"
