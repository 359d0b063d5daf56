"""Streaming bench: extract and train one after the other, against both at once under a disk budget.

On the fixture target (or the real SmolLM2-135M-Instruct, `--target smollm2`, answering real questions
from the `real` prompt sets), from one synth dataset of its greedy answers (made here, cached), side by side:
  sequential   eyas-extract run, then eyas-train run (one pass, random order): every shard on disk at once
  streamed     eyas-extract run --follow --disk-budget B and eyas-train run --follow --consume (one pass, shard
               order) started together; a thread samples the bytes of hidden shards on disk every 5 ms
Prints per mode: wall time, each stage's busy time (extraction compute, training loop), the peak bytes of
hidden shards on disk over the full dataset's bytes (goal <= 0.15), and the acceptance length at 3 draft
tokens of the draft on held-out prompts (`eyas-train eval`, which counts as vLLM does; goal: within 0.05).
The budget is --budget times the full dataset's bytes (as the sequential run measured them).

    .venv/bin/python bench/stream.py [--target fixture|smollm2] [--samples 400] [--budget 0.13] [--prompts 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from eyas_common.contract import Dataset
from eyas_common.paths import cache_root
from eyas_common.realprompts import real_prompts, write_real_prompts
from eyas_testing.datasets import generate_samples, write_synth
from eyas_testing.fixture import build_fixture, write_prompts_jsonl
from eyas_testing.fixture_smollm2 import build_smollm2_fixture
from eyas_testing.peak import PeakBytes
from eyas_train.eval import evaluate

BIN = Path(sys.executable).parent
# one pass (--epochs 1: the recipe at scale) over all the data in both modes (--patience 0: no early stop)
TRAIN = ["--epochs", "1", "--batch-size", "4", "--ckpt-every", "2", "--log-every", "25", "--patience", "0"]


class Target(NamedTuple):
    """How a target is built and streamed. Under --consume a streamed run holds at once its validation shards,
    up to batch - 1 shards of samples a batch carries into the next window, and a window: that must fit in
    the budget (eyas-train stops with the budget it needs otherwise), so a few hundred samples are cut small."""
    build: Callable[[], Path]
    draft_vocab: int
    max_new: int        # the longest answer generated
    shard_samples: int
    window_shards: int
    val_samples: int    # taken from the first window
    eval_prompts: int   # held-out prompts the acceptance is measured on (`eyas-train eval`, up to max_new tokens)


TARGETS = {"fixture": Target(build_fixture, 2048, 256, 4, 4, 8, 40),
           # 128 answers of about 200 tokens: at most 2 + 3 + 6 one-sample shards on disk, ~0.11 of the whole;
           # a 135M target answers a prompt in ~40 s on a busy 2-core CPU: fewer held-out prompts
           "smollm2": Target(build_smollm2_fixture, 8192, 192, 1, 6, 2, 16)}


def start(root: Path, tool: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "EYAS_DATA": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(BIN / tool), "run", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(root / f"{tool}.{time.monotonic_ns()}.log", "w"))


def finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{p.args[0]} failed (exit {p.returncode}): see the logs under {Path(p.args[0]).parent}")


def busy(root: Path, name: str) -> tuple[float, float]:
    """(extraction compute seconds, training loop seconds) of hidden/NAME and drafts/NAME."""
    h = Dataset.parse(name, "hidden", root).read_manifest()["stats"]
    d = Dataset.parse(name, "drafts", root).read_manifest()["stats"]
    return sum(w.get("compute_s", 0) for w in h.get("workers", [])), d["train_s"]


def run_mode(root: Path, model: Path, name: str, t: Target, budget: int | None) -> dict[str, float]:
    common = ["--model", str(model), "--name", name]
    extract = ["--shard-samples", str(t.shard_samples)]
    train = [*TRAIN, "--draft-vocab", str(t.draft_vocab), "--window-shards", str(t.window_shards), "--val-samples",
             str(t.val_samples)]
    t0 = time.monotonic()
    with PeakBytes(root / "hidden" / name) as peak:
        if budget is None:
            finish(start(root, "eyas-extract", "--synth", "synth/bench", *common, *extract))
            finish(start(root, "eyas-train", "--hidden", f"hidden/{name}", *common, *train))
        else:
            ex = start(root, "eyas-extract", "--synth", "synth/bench", *common, *extract, "--follow",
                       "--poll-seconds", "0.1", "--disk-budget", str(budget))
            tr = start(root, "eyas-train", "--hidden", f"hidden/{name}", *common, *train, "--follow", "--consume",
                       "--poll-seconds", "0.1")
            finish(ex, tr)
    wall = time.monotonic() - t0
    extract_s, train_s = busy(root, name)
    hm = Dataset.parse(name, "hidden", root).read_manifest()
    return {"wall_s": wall, "extract_s": extract_s, "train_s": train_s, "peak": peak.peak,
            "full": sum(e["bytes"] for e in hm["files"] if e["name"].startswith("shard-"))}


def cached_samples(target: str, model: Path, n: int, max_new: int) -> list[dict]:
    """The target's greedy answers to N training prompts, generated once and cached."""
    cached = cache_root() / "bench-stream" / (f"synth-{n}.jsonl" if target == "fixture" else f"{target}-{n}.jsonl")
    if not cached.exists():
        prompts = None if target == "fixture" else real_prompts("real", "train", n=n, seed=0)
        made = generate_samples(model, n, seed=0, max_new_tokens=max_new, prompts=prompts)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text("".join(json.dumps(s) + "\n" for s in made))
    return [json.loads(x) for x in cached.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="fixture", help="the target (default: fixture)")
    ap.add_argument("--samples", type=int, default=400, help="synth samples (the target's greedy answers)")
    ap.add_argument("--budget", type=float, default=0.13, help="disk budget, as a share of the full hidden bytes")
    ap.add_argument("--prompts", type=int, default=None,
                    help="held-out prompts for the acceptance eval (default: fixture 40, smollm2 16)")
    a = ap.parse_args()
    t = TARGETS[a.target]
    n_prompts = a.prompts or t.eval_prompts
    model = t.build()
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-stream-"))
    write_synth(root, "bench", cached_samples(a.target, model, a.samples, t.max_new), model)
    heldout = root / "heldout.jsonl"
    if a.target == "fixture":
        write_prompts_jsonl(heldout, n_prompts, seed=1)
    else:
        write_real_prompts(heldout, "real", "heldout", n=n_prompts, seed=1)

    seq = run_mode(root, model, "seq", t, budget=None)
    stream = run_mode(root, model, "stream", t, budget=int(a.budget * seq["full"]))
    print(f"\n{a.target} target, {a.samples} samples, one pass at batch 4, draft vocabulary {t.draft_vocab}, shards of "
          f"{t.shard_samples} samples, windows of {t.window_shards} shards, {t.val_samples} validation samples, "
          f"budget {a.budget:.2f} x {seq['full'] / 1e6:.1f} MB")
    print(f"{'mode':<11}{'wall s':>8}{'extract s':>11}{'train s':>9}{'peak MB':>9}{'peak/full':>11}{'acc@3':>7}")
    for mode, r in (("sequential", seq), ("streamed", stream)):
        acc = evaluate(draft=f"drafts/{'seq' if r is seq else 'stream'}", model=model, prompts=heldout,
                       spec_tokens=3, max_tokens=t.max_new, data_root=root)["acceptance_length"]
        r["acc"] = acc
        print(f"{mode:<11}{r['wall_s']:>8.1f}{r['extract_s']:>11.1f}{r['train_s']:>9.1f}{r['peak'] / 1e6:>9.2f}"
              f"{r['peak'] / r['full']:>11.3f}{acc:>7.2f}")
    print(f"streamed / sequential wall time {stream['wall_s'] / seq['wall_s']:.2f}; peak disk ratio "
          f"{stream['peak'] / stream['full']:.3f} (goal <= 0.15); acceptance difference "
          f"{stream['acc'] - seq['acc']:+.2f} (goal within 0.05)")
    print(f"(the stage busy times sum to {seq['extract_s'] + seq['train_s']:.1f} s sequential: on separate hosts the "
          f"streamed wall time tends to the longer one, {max(stream['extract_s'], stream['train_s']):.1f} s)")


if __name__ == "__main__":
    main()
