"""Draft quality of training recipes (`eyas-train run`'s defaults, the best hand one, the cheap one), in real vLLM.

For each tiny thinking target and data size:
  1. synth N answers of the target through vLLM (CPU) to training prompts (eyas-synth);
  2. extract its hidden states (eyas-extract, hf);
  3. train one draft per recipe: `defaults` (resolved from the data), `hand` (the best found by hand), `fast`
     (the sampled head at TTT depth K + 1: the cheaper step);
  4. serve target + draft in vLLM at 3 speculative tokens and run `eyas-serve bench` on held-out prompts
     (problems of the fixture's held-out split: neither training nor the rule ever saw them) at 1, 4 and
     16 requests in flight, against the target served alone: the acceptance length from vLLM's spec-decode
     counters, the speedup from tokens/s.
Targets: `llama` (fixture.py: Kimi-style template that opens `<think>` in the prompt, 8 layers, vocab 3000),
`qwen3` (fixture_qwen3.py: Qwen3 architecture that emits `<think>` itself, 10 layers, vocab 4000), and the
real `smollm2` (SmolLM2-135M-Instruct from its PyPI wheel: 30 layers, vocab 49,152, no thinking), which
answers real questions (realprompts.py: TruthfulQA, MMLU, HumanEval; held-out ones for the measurement).
It prints one row per target x size x method x recipe: vLLM's acceptance, the acceptance `eyas-train run`
predicted from its validation slice, the speedups, and the training time.
`--method eagle3,dflash` trains both draft methods on the same synth answers (each from its own extraction:
DFlash reads five layers) and measures EAGLE-3 at 3 speculative tokens, DFlash at its block size - 1 (the K
its blocks were trained for; vLLM runs K + 1 queries, so another K would show it blocks it never saw).

    .venv/bin/python bench/quality.py --quick                   # llama, 250 samples (fits CI)
    .venv/bin/python bench/quality.py                           # llama + qwen3 x 250 / 1000 / 4000
    .venv/bin/python bench/quality.py --targets qwen3 --sizes 250,1000
    .venv/bin/python bench/quality.py --quick --method eagle3,dflash   # the two methods side by side

Datasets and results go under $EYAS_DATA (default ./data/bench-quality); a rerun reuses every finished
dataset, draft and measurement, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from eyas_common.bench import read_results
from eyas_common.contract import MANIFEST, Dataset, write_json_atomic
from eyas_common.drafts import WEIGHTS_FILE, served_spec_tokens
from eyas_common.methods import DEFAULT_METHOD, METHODS
from eyas_common.procs import sigterm_as_interrupt
from eyas_common.samples import SAMPLES, index_samples, read_tokens
from eyas_testing.fixture import build_fixture, write_prompts_jsonl
from eyas_testing.fixture_qwen3 import build_qwen3_fixture
from eyas_testing.fixture_smollm2 import build_smollm2_fixture
from eyas_common.realprompts import write_real_prompts
from eyas_testing.servers import running_vllm
from eyas_serve.bench import run as bench
from eyas_serve.engines import prompt_lookup_config

ROOT = Path(__file__).resolve().parents[1]
SPEC_TOKENS, HELDOUT = 3, 40
SPEEDUP_AT = (1, 4, 16)  # requests in flight of each cell's speedup (draft over the target alone, tokens/s)
# target name -> (builder, vLLM flags for synth, vLLM flags for the measurement, prompt set)
TARGETS = {"llama": (build_fixture, ["--reasoning-parser", "kimi_k2"], [], "fixture"),
           "qwen3": (build_qwen3_fixture, ["--reasoning-parser", "qwen3"], [], "fixture"),
           # 30 layers: eager mode starts in about a minute on CPU, graph capture takes several; synth serves
           # 2,048 tokens of context (some MMLU questions run past 1,000 tokens, and an answer takes 256 more)
           "smollm2": (build_smollm2_fixture, ["--enforce-eager", "--max-model-len", "2048"], ["--enforce-eager"],
                       "real")}
# The best hand recipe found on the Llama fixture (stages/03_train/README.md): all samples, no validation, and
# on a fixture's prompt set a 1,024-token draft vocabulary. A real target keeps the default 32,000: on SmolLM2 (500
# training answers, 5,276 distinct tokens) 1,024 covers 74% of the held-out answers' tokens, 8,192 92%, 32,000 99%
# (the table's "held-out coverage"; past the tokens seen, ties go to lower ids: BPE's earlier, commoner merges).
HAND = {"fixture": dict(epochs=20, batch_size=4, lr=3e-3, draft_vocab=1024, val_samples=0),
        "real": dict(epochs=20, batch_size=4, lr=3e-3, val_samples=0)}
# The cheaper step (bench/RESULTS.md, "The sampled lm_head loss"): the sampled head, TTT depth K + 1, and
# on a real target two passes of batch 4 (SmolLM2 x 2,000: about 1,000 steps, half an hour on 2 CPU cores).
FAST = {"fixture": dict(head_negatives=256, ttt_steps=SPEC_TOKENS + 1),
        "real": dict(head_negatives=256, ttt_steps=SPEC_TOKENS + 1, epochs=2, batch_size=4, val_samples=32)}
RECIPES = {"defaults": {"fixture": {}, "real": {}}, "hand": HAND, "fast": FAST}
# What a recipe drops for a method: DFlash drafts over the target's whole vocabulary (no --draft-vocab) and has
# no unrolled steps or sampled head.
NOT_FOR = {"eagle3": (), "dflash": ("draft_vocab", "head_negatives", "ttt_steps")}
QUIET = dict(log_every=100, ckpt_every=100)  # a checkpoint every 100 steps: a real target trains for hours on a CPU
# A shard is what an interrupted extraction keeps: 250 of SmolLM2's answers are about 2 min on 2 CPU cores (the
# default 2 GiB holds its whole 2,000-sample cell: one shard, lost whole to a kill)
SHARD_SAMPLES = 250


def say(msg: str) -> None:
    print(f"[bench-quality] {msg}", file=sys.stderr, flush=True)


def synth_all(root: Path, target: str, model: Path, sizes: list[int], heldout: Path) -> None:
    """One vLLM server for the target answers every size's training prompts (datasets synth/T_N) and the
    held-out prompts (synth/T_heldout: what each draft's vocabulary coverage is measured on)."""
    from eyas_synth.run import run as synth

    todo = {f"{target}_{n}": n for n in sizes} | {f"{target}_heldout": HELDOUT}
    todo = {name: n for name, n in todo.items() if not _complete(root, name, "synth")}
    if not todo:
        return
    with running_vllm(model, log_path=root / "logs" / f"synth_{target}.log", timeout_s=900,
                      extra_args=TARGETS[target][1]) as server:
        for name, n in todo.items():
            prompts = (heldout if name.endswith("_heldout") else
                       write_prompts(root / "prompts" / f"{target}_train_{n}.jsonl", target, n, 0, "train"))
            say(f"{name}: synth {n} samples")
            # the tiny targets sometimes leave a thinking block unclosed: those answers are rejected
            synth(prompts=prompts, name=name, model=model, servers=[server.url], n=n, max_tokens=256,
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


def draft_name(target: str, n: int, recipe: str, seed: int, method: str = DEFAULT_METHOD) -> str:
    """`T_N_RECIPE`, `_dflash` after it for a DFlash draft, and `-seedS` for seeds other than 0 (so EAGLE-3's
    seed 0 keeps its cached results)."""
    return f"{target}_{n}_{recipe}" + _method_suffix(method) + (f"-seed{seed}" if seed else "")


def hidden_name(target: str, n: int, method: str) -> str:
    """The hidden dataset a method trains on: `T_N` (EAGLE-3's three layers), `T_N_dflash` (DFlash's five)."""
    return f"{target}_{n}" + _method_suffix(method)


def _method_suffix(method: str) -> str:
    return "" if method == DEFAULT_METHOD else f"_{method}"


def recipe_options(recipe: str, method: str, target: str) -> dict[str, Any]:
    """`eyas-train run` options of a recipe for a method and target (the method itself among them)."""
    options = RECIPES[recipe][TARGETS[target][3]]
    return {k: v for k, v in options.items() if k not in NOT_FOR[method]} | {"method": method}


def heldout_coverage(t2d: torch.Tensor | None, answers: list[tuple[list[int], list[int]]]) -> float:
    """Share of the answer tokens (loss-masked ids) inside a draft vocabulary (t2d; None: the whole target
    vocabulary): a ceiling on how often a draft token can be the target's."""
    ids = torch.tensor([t for input_ids, mask in answers for t, m in zip(input_ids, mask) if m], dtype=torch.long)
    return 1.0 if t2d is None else float(t2d[ids].float().mean())


def draft_coverage(draft: Path, root: Path, target: str) -> float | None:
    """heldout_coverage of a draft over the target's answers to the held-out prompts (synth/T_heldout)."""
    from safetensors import safe_open

    synth = Dataset.parse(f"{target}_heldout", "synth", root)
    if not _complete(root, synth.name, "synth"):
        return None
    samples = synth.path / SAMPLES
    refs = index_samples(samples, json.loads((synth.path / MANIFEST).read_text())["target"]["vocab_size"])
    with safe_open(str(draft / WEIGHTS_FILE), "pt") as f:
        t2d = f.get_tensor("t2d").bool() if "t2d" in f.keys() else None
    return heldout_coverage(t2d, read_tokens(samples, refs))


def train_one(root: Path, target: str, model: Path, n: int, recipe: str, seed: int = 0,
              method: str = "eagle3", allow_code_change: bool = False) -> Path:
    from eyas_extract.run import run as extract
    from eyas_train.train import run as train

    name = hidden_name(target, n, method)
    if not _complete(root, name, "hidden"):
        say(f"{name}: extract ({method} layers)")
        extract(synth=f"synth/{target}_{n}", model=model, name=name, method=method, data_root=root, progress=False,
                shard_samples=SHARD_SAMPLES, allow_code_change=allow_code_change)
    draft = draft_name(target, n, recipe, seed, method)
    if not _complete(root, draft, "drafts"):
        say(f"{draft}: train")
        train(hidden=f"hidden/{name}", model=model, name=draft, data_root=root, seed=seed,
              allow_code_change=allow_code_change, **recipe_options(recipe, method, target), **QUIET)
    return Dataset.parse(draft, "drafts", root).path


class Baseline:
    """The target served without a draft, started on first use (not at all when every cell is cached): what
    each cell's speedup is measured against."""

    def __init__(self, root: Path, target: str, model: Path) -> None:
        self.root, self.target, self.model = root, target, model
        self.stack = ExitStack()
        self.server = None

    def url(self) -> str:
        if self.server is None:
            say(f"{self.target}: the target without a draft (the speedups' baseline)")
            self.server = self.stack.enter_context(running_vllm(
                self.model, log_path=self.root / "logs" / f"baseline_{self.target}.log", timeout_s=900,
                extra_args=TARGETS[self.target][2]))
        return self.server.url

    def close(self) -> None:
        self.stack.close()


def measure(root: Path, target: str, model: Path, n: int, recipe: str, heldout: Path, baseline: Baseline,
            seed: int = 0, method: str = "eagle3", allow_code_change: bool = False) -> dict[str, Any]:
    """One cell's result for one recipe, seed and method: `eyas-serve bench` of the draft served in vLLM against
    the target alone, at SPEEDUP_AT requests in flight (cached in results/<draft_name>.json)."""
    label = draft_name(target, n, recipe, seed, method)
    out = root / "results" / f"{label}.json"
    if out.exists() and measured_at(result := json.loads(out.read_text())) == list(SPEEDUP_AT):
        if result.get("heldout_coverage") is None:  # cached before coverage was measured, or before T_heldout
            result["heldout_coverage"] = draft_coverage(Dataset.parse(label, "drafts", root).path, root, target)
            write_json_atomic(out, result)
        return result
    draft = train_one(root, target, model, n, recipe, seed, method, allow_code_change)
    k = served_spec_tokens(draft, SPEC_TOKENS)
    # a bench per set of levels: a cell measured at other levels keeps its bench, and is measured again here
    name = f"{label}_at_{'-'.join(map(str, SPEEDUP_AT))}"
    if not _complete(root, name, "bench"):
        say(f"{label}: eyas-serve bench on {HELDOUT} held-out prompts at {k} speculative tokens, "
            f"{' / '.join(map(str, SPEEDUP_AT))} in flight")
        with running_vllm(model, log_path=root / "logs" / f"vllm_{label}.log", timeout_s=900, draft=draft,
                          spec_tokens=k, extra_args=TARGETS[target][2]) as server:
            bench(server=server.url, baseline=baseline.url(), prompts=heldout, name=name, draft=f"drafts/{label}",
                  concurrency=SPEEDUP_AT, data_root=root)
    _, _, results = read_results(f"bench/{name}", root)
    m = json.loads((draft / MANIFEST).read_text())
    val = m["stats"].get("val") or {}
    predicted = (m["stats"].get("predicted_acceptance") or {}).get(str(k))
    chain = (val.get("val_chain_product") or [None] * k)[k - 1]
    result = {"target": target, "samples": n, "recipe": recipe, "method": method, "spec_tokens": k,
              "vllm": results["spec"], "speedup": {str(lv["concurrency"]): lv["speedup"] for lv in results["levels"]},
              "predicted": predicted, "chain": chain, "train_s": m["stats"]["train_s"], "steps": m["stats"]["steps"],
              "resolved": m["params"]["recipe"], "heldout_coverage": draft_coverage(draft, root, target)}
    write_json_atomic(out, result)
    return result


def prompt_lookup(root: Path, target: str, model: Path, heldout: Path, baseline: Baseline) -> str:
    """vLLM's prompt lookup, served as `eyas-serve launch --prompt-lookup` serves it, on the held-out prompts at
    SPEEDUP_AT in flight against the target alone, as one line. Its acceptance length counts only the steps where
    an n-gram matched and it drafted; tokens per target step counts every step, as a draft that proposes on
    every step (EAGLE-3) counts."""
    name = f"{target}_prompt_lookup_at_{'-'.join(map(str, SPEEDUP_AT))}"
    lookup = prompt_lookup_config(SPEC_TOKENS)  # for the line printed
    if not _complete(root, name, "bench"):
        say(f"{target}: vLLM's prompt lookup on {HELDOUT} held-out prompts, "
            f"{' / '.join(map(str, SPEEDUP_AT))} in flight")
        with running_vllm(model, log_path=root / "logs" / f"vllm_{name}.log", timeout_s=900, prompt_lookup=True,
                          spec_tokens=SPEC_TOKENS, extra_args=TARGETS[target][2]) as server:
            bench(server=server.url, baseline=baseline.url(), prompts=heldout, name=name, concurrency=SPEEDUP_AT,
                  data_root=root)
    _, _, results = read_results(f"bench/{name}", root)
    spec = results["spec"]
    steps = sum(lv["draft"]["output_tokens"] for lv in results["levels"]) / spec["tokens_per_step"]
    speedups = " ".join("n/a" if lv["speedup"] is None else f"{lv['speedup']:.2f}x" for lv in results["levels"])
    return (f"{target}: prompt lookup (vLLM n-gram {lookup['prompt_lookup_min']}-"
            f"{lookup['prompt_lookup_max']}, K {SPEC_TOKENS}, no draft model): "
            f"{_f(spec['tokens_per_step'])} tokens per target step; acceptance length "
            f"{_f(spec['acceptance_length'])} over the {spec['drafts'] / steps:.0%} of steps it drafted on; "
            f"speedup {speedups} at {' / '.join(map(str, SPEEDUP_AT))} in flight")


def measured_at(result: dict[str, Any]) -> list[int]:
    """The requests in flight a cached result's speedups were measured at (none before speedups were)."""
    return sorted(int(c) for c in result.get("speedup") or {})


def table(rows: list[dict[str, list[dict[str, Any]]]]) -> str:
    """One line per target x size x method x recipe; with several seeds a value is their mean, the range beside it."""
    lines = ["| target | samples | method (K) | recipe | vLLM acceptance | predicted (chain product) | speedup "
             f"{' / '.join(map(str, SPEEDUP_AT))} | train s | held-out coverage | resolved (seed 0) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for recipe, cells in r.items():
            cell, res = cells[0], cells[0]["resolved"]
            lines.append(
                f"| {cell['target']} | {cell['samples']} | {cell.get('method', 'eagle3')} "
                f"({cell.get('spec_tokens', SPEC_TOKENS)}) | {recipe} | {_spread(cells)} "
                f"| {_f(_mean(x['predicted'] for x in cells))} ({_f(_mean(x.get('chain') for x in cells))}) "
                f"| {_speedups(cells)} | {_f(_mean(x['train_s'] for x in cells), 0)} "
                f"| {_f(_mean(x.get('heldout_coverage') for x in cells), 3)} "
                f"| batch {res['batch_size']}, lr {res['lr']:.2g}, {res['total_steps']} steps |")
    return "\n".join(lines)


def _speedups(results: list[dict[str, Any]]) -> str:
    """Mean speedup at each of SPEEDUP_AT, `1.21x 1.38x 1.50x`; `-` for results measured before speedups were,
    and for a level a result was not measured at."""
    if not results or any("speedup" not in x for x in results):
        return "-"
    means = [_mean(x["speedup"].get(str(c)) for x in results) for c in SPEEDUP_AT]
    return " ".join("-" if m is None else f"{m:.2f}x" for m in means)


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
    p.add_argument("--recipes", default="defaults,hand", help=f"comma-separated: {', '.join(RECIPES)}")
    p.add_argument("--method", default="eagle3",
                   help=f"comma-separated draft methods, one row each: {', '.join(METHODS)} (default eagle3)")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds 0..S-1 per recipe and cell; the table shows their mean and range (default 1)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="also measure vLLM's prompt lookup (n-gram speculation from the request's own tokens, no "
                        "draft model) on each target's held-out prompts: the reference a trained draft must beat")
    p.add_argument("--allow-code-change", action="store_true",
                   help="resume a cell's extraction or training that an earlier commit started (its manifest then "
                        "lists both versions); without it such a cell is refused")
    a = p.parse_args()
    targets = ["llama"] if a.quick else a.targets.split(",")
    sizes = [250] if a.quick else [int(x) for x in a.sizes.split(",")]
    recipes, methods = a.recipes.split(","), a.method.split(",")
    bad = ([t for t in targets if t not in TARGETS] + [r for r in recipes if r not in RECIPES]
           + [m for m in methods if m not in METHODS])
    if bad:
        p.error(f"unknown target, recipe or method {bad}: targets are {list(TARGETS)}, recipes {list(RECIPES)}, "
                f"methods {list(METHODS)}")
    if any(n < 20 for n in sizes):
        p.error(f"--sizes {a.sizes}: every size must be at least 20 samples")
    if a.seeds < 1:
        p.error(f"--seeds {a.seeds}: at least 1")
    root = Path(os.environ.get("EYAS_DATA", ROOT / "data" / "bench-quality"))
    t0 = time.monotonic()
    rows, references = [], []
    for target in targets:
        model = TARGETS[target][0]()
        heldout = write_prompts(root / "prompts" / f"{target}_heldout.jsonl", target, HELDOUT, 11, "heldout")
        synth_all(root, target, model, sizes, heldout)
        baseline = Baseline(root, target, model)
        try:
            if a.prompt_lookup:  # minutes: before the cells, which train for hours on a CPU
                references.append(prompt_lookup(root, target, model, heldout, baseline))
                print("\n".join(references), flush=True)
            for n in sorted(sizes):
                for method in methods:
                    rows.append({r: [measure(root, target, model, n, r, heldout, baseline, seed, method,
                                             a.allow_code_change)
                                     for seed in range(a.seeds)] for r in recipes})
                    print(table(rows), flush=True)
        finally:
            baseline.close()
    if references:
        print("\n" + "\n".join(references))
    print(f"\nvLLM at K speculative tokens (EAGLE-3 {SPEC_TOKENS}, DFlash block size - 1), {HELDOUT} held-out "
          f"prompts, greedy; speedup: tokens/s of target + draft over the target alone at "
          f"{' / '.join(map(str, SPEEDUP_AT))} in flight (eyas-serve bench); recipes: {RECIPES}; "
          f"{time.monotonic() - t0:.0f} s; data under {root}")


if __name__ == "__main__":
    try:
        with sigterm_as_interrupt():  # a kill stops the vLLM servers as Ctrl-C does (their `with` blocks run)
            main()
    except KeyboardInterrupt:
        say("interrupted: every finished dataset, draft and result is kept; rerun the same command to continue")
        sys.exit(130)
