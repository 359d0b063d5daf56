"""Draft quality with `eyas-train run`'s defaults against the best hand recipe, measured in real vLLM.

For each tiny thinking target and data size:
  1. synth N answers of the target through vLLM (CPU) to training prompts (eyas-synth);
  2. extract its hidden states (eyas-extract, hf);
  3. train one draft with the defaults (the recipe resolved from the data) and one with the hand recipe;
  4. serve target + draft in vLLM at 3 speculative tokens and answer held-out prompts (problems of the
     fixture's held-out split: neither training nor the rule ever saw them); read the acceptance length
     from vLLM's spec-decode counters.
Targets: `llama` (fixture.py: Kimi-style template that opens `<think>` in the prompt, 8 layers, vocab 3000),
`qwen3` (fixture_qwen3.py: Qwen3 architecture that emits `<think>` itself, 10 layers, vocab 4000), and the
real `smollm2` (SmolLM2-135M-Instruct from its PyPI wheel: 30 layers, vocab 49,152, no thinking), which
answers real questions (realprompts.py: TruthfulQA, MMLU, HumanEval; held-out ones for the measurement).
It prints one row per target x size: acceptance with the defaults and with the hand recipe, their ratio,
the acceptance `eyas-train run` predicted from its validation slice against vLLM's, and training times.

    .venv/bin/python bench/quality.py --quick                   # llama, 250 samples (fits CI)
    .venv/bin/python bench/quality.py                           # llama + qwen3 x 250 / 1000 / 4000
    .venv/bin/python bench/quality.py --targets qwen3 --sizes 250,1000

Datasets and results go under $EYAS_DATA (default ./data/bench-quality); a rerun reuses every finished
dataset, draft and measurement, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from eyas_common.contract import MANIFEST, Dataset, write_json_atomic
from eyas_testing.fixture import build_fixture, write_prompts_jsonl
from eyas_testing.fixture_qwen3 import build_qwen3_fixture
from eyas_testing.fixture_smollm2 import build_smollm2_fixture
from eyas_common.realprompts import write_real_prompts
from eyas_testing.servers import running_vllm
from eyas_testing.acceptance import vllm_acceptance

ROOT = Path(__file__).resolve().parents[1]
SPEC_TOKENS, HELDOUT = 3, 40
# target name -> (builder, vLLM flags for synth, vLLM flags for the measurement, prompt set)
TARGETS = {"llama": (build_fixture, ["--reasoning-parser", "kimi_k2"], [], "fixture"),
           "qwen3": (build_qwen3_fixture, ["--reasoning-parser", "qwen3"], [], "fixture"),
           # 30 layers: eager mode starts in about a minute on CPU, graph capture takes several
           "smollm2": (build_smollm2_fixture, ["--enforce-eager"], ["--enforce-eager"], "real")}
# The best hand recipe found on the Llama fixture (stages/03_train/README.md): all samples, no validation.
HAND = dict(epochs=20, batch_size=4, lr=3e-3, draft_vocab=1024, val_samples=0)
RECIPES: dict[str, dict[str, Any]] = {"defaults": {}, "hand": HAND}
QUIET = dict(log_every=100, ckpt_every=1000)


def say(msg: str) -> None:
    print(f"[bench-quality] {msg}", file=sys.stderr, flush=True)


def synth_all(root: Path, target: str, model: Path, sizes: list[int]) -> None:
    """One vLLM server for the target answers every size's training prompts (datasets synth/T_N)."""
    from eyas_synth.run import run as synth

    todo = [n for n in sizes if not _complete(root, f"{target}_{n}", "synth")]
    if not todo:
        return
    with running_vllm(model, log_path=root / "logs" / f"synth_{target}.log", timeout_s=900,
                      extra_args=TARGETS[target][1]) as server:
        for n in todo:
            prompts = write_prompts(root / "prompts" / f"{target}_train_{n}.jsonl", target, n, 0, "train")
            say(f"{target}: synth {n} samples")
            # the tiny targets sometimes leave a thinking block unclosed: those answers are rejected
            synth(prompts=prompts, name=f"{target}_{n}", model=model, servers=[server.url], n=n, max_tokens=256,
                  temperature=0.0, concurrency=32, allow_rejected="3%", data_root=root, progress=False)


def write_prompts(path: Path, target: str, n: int, seed: int, split: str) -> Path:
    """The target's prompt set: the fixtures' own tasks, or real questions for a real target."""
    if TARGETS[target][3] == "fixture":
        return write_prompts_jsonl(path, n, seed=seed, split=split)
    write_real_prompts(path, TARGETS[target][3], split, n=n, seed=seed)
    return path


def _complete(root: Path, name: str, kind: str) -> bool:
    ds = Dataset.parse(name, kind, root)
    return ds.exists() and ds.read_manifest().get("status") == "complete"


def draft_name(target: str, n: int, recipe: str, seed: int) -> str:
    """`T_N_RECIPE`, and `-seedS` after it for seeds other than 0 (so seed 0 keeps its cached results)."""
    return f"{target}_{n}_{recipe}" + (f"-seed{seed}" if seed else "")


def train_one(root: Path, target: str, model: Path, n: int, recipe: str, seed: int = 0) -> Path:
    from eyas_extract.run import run as extract
    from eyas_train.train import run as train

    name = f"{target}_{n}"
    if not _complete(root, name, "hidden"):
        say(f"{name}: extract")
        extract(synth=f"synth/{name}", model=model, name=name, data_root=root, progress=False)
    draft = draft_name(target, n, recipe, seed)
    if not _complete(root, draft, "drafts"):
        say(f"{draft}: train")
        train(hidden=f"hidden/{name}", model=model, name=draft, data_root=root, seed=seed, **RECIPES[recipe],
              **QUIET)
    return Dataset.parse(draft, "drafts", root).path


def measure(root: Path, target: str, model: Path, n: int, recipe: str, heldout: Path, seed: int = 0
            ) -> dict[str, Any]:
    """One cell's result for one recipe and seed (cached in results/T_N_RECIPE[-seedS].json)."""
    label = draft_name(target, n, recipe, seed)
    out = root / "results" / f"{label}.json"
    if out.exists():
        return json.loads(out.read_text())
    draft = train_one(root, target, model, n, recipe, seed)
    say(f"{label}: vLLM acceptance on {HELDOUT} held-out prompts")
    acc = vllm_acceptance(model, draft, heldout, root / "logs" / f"vllm_{label}.log", spec_tokens=SPEC_TOKENS,
                          extra_args=TARGETS[target][2])
    m = json.loads((draft / MANIFEST).read_text())
    val = m["stats"].get("val") or {}
    predicted = (m["stats"].get("predicted_acceptance") or {}).get(str(SPEC_TOKENS))
    chain = (val.get("val_chain_product") or [None] * SPEC_TOKENS)[SPEC_TOKENS - 1]
    result = {"target": target, "samples": n, "recipe": recipe, "vllm": acc, "predicted": predicted, "chain": chain,
              "train_s": m["stats"]["train_s"], "steps": m["stats"]["steps"], "resolved": m["params"]["recipe"]}
    write_json_atomic(out, result)
    return result


def table(rows: list[dict[str, list[dict[str, Any]]]]) -> str:
    """One line per target x size; with several seeds a value is their mean, the range beside it."""
    head = ("| target | samples | defaults | best hand | ratio | predicted (chain product) vs vLLM, defaults "
            "| train s defaults / hand | defaults resolved to (seed 0) |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        d, h = r.get("defaults") or [], r.get("hand") or []
        ad, ah = _mean(x["vllm"]["acceptance_length"] for x in d), _mean(x["vllm"]["acceptance_length"] for x in h)
        cell, res = (d or h)[0], d and d[0]["resolved"]
        lines.append(
            f"| {cell['target']} | {cell['samples']} | {_spread(d)} | {_spread(h)} "
            f"| {_f(ad / ah if ad and ah else None, 3)} "
            f"| {_f(_mean(x['predicted'] for x in d))} ({_f(_mean(x.get('chain') for x in d))}) vs {_f(ad)} "
            f"| {_f(_mean(x['train_s'] for x in d), 0)} / {_f(_mean(x['train_s'] for x in h), 0)} "
            f"| {'batch %d, lr %.2g, %d steps' % (res['batch_size'], res['lr'], res['total_steps']) if res else '-'} |")
    return "\n".join(lines)


def _mean(values: Any) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def _spread(results: list[dict[str, Any]]) -> str:
    """Mean acceptance over the seeds, and `(min-max, k seeds)` when there are several."""
    a = [x["vllm"]["acceptance_length"] for x in results]
    if len(a) < 2:
        return _f(_mean(a))
    return f"{_f(_mean(a))} ({min(a):.2f}-{max(a):.2f}, {len(a)} seeds)"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one target, one size: llama x 250 (CI)")
    p.add_argument("--targets", default="llama,qwen3", help=f"comma-separated: {', '.join(TARGETS)}")
    p.add_argument("--sizes", default="250,1000,4000", help="comma-separated sample counts")
    p.add_argument("--recipes", default="defaults,hand", help="comma-separated: defaults, hand")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds 0..S-1 per recipe and cell; the table shows their mean and range (default 1)")
    a = p.parse_args()
    targets = ["llama"] if a.quick else a.targets.split(",")
    sizes = [250] if a.quick else [int(x) for x in a.sizes.split(",")]
    recipes = a.recipes.split(",")
    bad = [t for t in targets if t not in TARGETS] + [r for r in recipes if r not in RECIPES]
    if bad:
        p.error(f"unknown target or recipe {bad}: targets are {list(TARGETS)}, recipes {list(RECIPES)}")
    if any(n < 20 for n in sizes):
        p.error(f"--sizes {a.sizes}: every size must be at least 20 samples")
    if a.seeds < 1:
        p.error(f"--seeds {a.seeds}: at least 1")
    root = Path(os.environ.get("EYAS_DATA", ROOT / "data" / "bench-quality"))
    t0 = time.monotonic()
    rows = []
    for target in targets:
        model = TARGETS[target][0]()
        heldout = write_prompts(root / "prompts" / f"{target}_heldout.jsonl", target, HELDOUT, 11, "heldout")
        synth_all(root, target, model, sizes)
        for n in sorted(sizes):
            rows.append({r: [measure(root, target, model, n, r, heldout, seed) for seed in range(a.seeds)]
                         for r in recipes})
            print(table(rows), flush=True)
    print(f"\nvLLM {SPEC_TOKENS} speculative tokens, {HELDOUT} held-out prompts, greedy; hand recipe: {HAND}; "
          f"{time.monotonic() - t0:.0f} s; data under {root}")


if __name__ == "__main__":
    main()
