"""Training speed of the EAGLE-3 draft, measured side by side in one run (`make bench-train`).

Per draft shape (--shapes), on batches of synthetic samples whose lengths are drawn (seeded) log-uniformly
between --min-len and --max-len tokens (long-tailed: for 50-600, median 173, mean 221), the first third of
each sample its prompt (loss mask 0), timed forward + backward as eyas-train runs them:

    TTT / bare       tokens/s of the TTT step (the draft unrolled TTT times, --steps) over those of a bare step
                     of the same draft (one step: fc, the layer, lm_head and the same loss) on the same packed
                     large batch; the ideal is 1 / TTT (goal: at least 0.9 of it)
    packed, padded   useful (non-padding) tokens/s of the TTT step with the same samples packed end to end
                     (the default) and one right-padded sample per row (--batching padded), at each of
                     --batches (4, and 38: the rule's batch at 16,384 tokens a step on ~430-token samples);
                     goal: packed at least 1.5x padded at the large batch

A cell runs once to warm up, then until it has run --min-seconds (a first run over 5 s is timed alone); on a
CPU its time is the process's CPU time over its threads (wall time on a shared machine times the neighbours).

    .venv/bin/python bench/train.py            # fixture and SmolLM2-135M shapes (draft vocab 32,000 and 8,192)
    .venv/bin/python bench/train.py --quick    # fixture shape and SmolLM2 with 8,192 only, less timing
    python bench/train.py --shapes llama8b --batches 4,64   # a Llama-3-8B-sized draft on a GPU (adds MFU)
    .venv/bin/python bench/train.py --precision fp32,bf16    # bf16 autocast against fp32, side by side
    .venv/bin/python bench/train.py --steps 0:7,256:7,256:4  # exact head at 7 TTT steps, sampled at 7 and 4

The teacher rows are peaked as a real target's are (a few tokens, drawn Zipf-like from the draft vocabulary,
hold most of the mass), so the sampled head's columns per chunk are as many as on real data.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from eyas_train.data import collate
from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.parallel import autocast
from eyas_train.ttt import UnrolledLoss, step_counts

# name: (hidden, heads, kv heads, head dim, ffn, target vocab, draft vocab)
SHAPES = {
    "fixture": (128, 4, 2, 32, 320, 3000, 3000),
    "smollm2-32k": (576, 9, 3, 64, 1536, 49152, 32000),
    "smollm2-8k": (576, 9, 3, 64, 1536, 49152, 8192),
    "llama8b": (4096, 32, 8, 128, 14336, 128256, 32000),
}
WARM_UP_SECONDS = 5.0
# Dense bf16 peaks (FLOP/s) by device-name fragment; --peak-tflops overrides.
PEAKS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "RTX PRO 6000": 500e12,
         "5090": 210e12, "4090": 165e12}


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="fixture,smollm2-32k,smollm2-8k", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--batches", default="4,38", help="samples per step; the last one is the large batch")
    p.add_argument("--min-len", type=int, default=50)
    p.add_argument("--max-len", type=int, default=600)
    p.add_argument("--min-seconds", type=float, default=2.0, help="time each cell at least this long")
    p.add_argument("--max-rows", type=int, default=16,
                   help="rows per micro-batch (0: the whole batch at once); 16 fits a padded batch of 38 in ~8 GB")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads [default: torch's]; 1 times steadily on a machine shared with other work")
    p.add_argument("--precision", default="auto",
                   help="comma-separated, each of auto, fp32, bf16 (eyas-train's --precision, resolved the same way), "
                        "one row per shape and precision [default: auto]")
    p.add_argument("--steps", default="0:7",
                   help="comma-separated training steps, one row each, as NEGATIVES:TTT: eyas-train's --head-negatives "
                        "(0: the exact loss) and --ttt-steps [default: 0:7, the defaults]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="--shapes fixture,smollm2-8k --min-seconds 0")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU dense bf16 peak, TFLOP/s")
    a = p.parse_args()
    if bad := set(a.precision.split(",")) - {"auto", "fp32", "bf16"}:
        p.error(f"--precision {','.join(sorted(bad))}: expected auto, fp32 or bf16 (comma-separated)")
    if a.quick:
        a.shapes, a.min_seconds = "fixture,smollm2-8k", 0.0
    return a


def draft_for(shape: str, device: torch.device) -> Eagle3Draft:
    hidden, heads, kv, head_dim, ffn, vocab, draft_vocab = SHAPES[shape]
    cfg = DraftConfig(vocab_size=vocab, draft_vocab_size=draft_vocab, hidden_size=hidden, target_hidden_size=hidden,
                      num_aux=3, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      intermediate_size=ffn, rms_norm_eps=1e-6, max_position_embeddings=4096)
    draft = Eagle3Draft(cfg)
    draft.init_weights(0)
    return draft.to(device)


def lengths_for(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """Long-tailed sample lengths: log-uniform on [lo, hi] (density 1/L), seeded."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed)).double()
    return [int(lo * (hi / lo) ** x) for x in u.tolist()]


def samples_for(cfg: DraftConfig, lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """Random samples of these lengths with a teacher distribution over the draft vocabulary, as Teacher gives."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3:] = 1
        out.append({"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g), "loss_mask": mask,
                    "aux": torch.randn(n, 3 * cfg.hidden_size, generator=g),
                    "target_p": teacher_rows(n, cfg.draft_vocab_size, g),
                    "target_top": torch.randint(0, cfg.vocab_size, (n,), generator=g)})
    return out


def teacher_rows(n: int, vocab: int, g: torch.Generator, peaks: int = 4) -> torch.Tensor:
    """[n, vocab] distributions with `peaks` likely tokens a row (ids log-uniform: frequent ones low, as the
    draft vocabulary is ordered) holding ~95% of the mass, the rest a noisy tail."""
    logits = torch.randn(n, vocab, generator=g)
    ids = (vocab ** torch.rand(n, peaks, generator=g)).long().clamp(max=vocab) - 1
    return torch.softmax(logits.scatter_add_(1, ids, torch.full((n, peaks), math.log(vocab) + 2.0)), -1)


def timed(fn: Callable[[], None], min_seconds: float, device: torch.device) -> tuple[float, int]:
    """Seconds of the fastest call and calls timed. The first call warms up (allocations, kernels). On a GPU it
    is never timed: growing the allocator's pool can take seconds there (measured on an H200: 9.0 s for a
    first Llama-8B-sized TTT step that then ran in well under one). On a CPU it is the one timed when it took
    over WARM_UP_SECONDS (one-off costs are small against it); else calls repeat until min_seconds. On a CPU,
    the process's own CPU time over its threads: on a machine shared with other work, wall time would time
    the neighbours too (on a quiet one the two agree)."""
    if device.type == "cuda":
        def clock() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()
    else:
        def clock() -> float:
            return time.process_time() / torch.get_num_threads()
    t0 = clock()
    fn()
    first = clock() - t0
    if first > WARM_UP_SECONDS and device.type != "cuda":
        return first, 1
    best, start = math.inf, clock()
    calls = 0
    while calls == 0 or clock() - start < min_seconds:
        t0 = clock()
        fn()
        best, calls = min(best, clock() - t0), calls + 1
    return best, calls


def train_step(draft: Eagle3Draft, steps: int, batch: dict[str, torch.Tensor], device: torch.device,
               max_rows: int, precision: str, negatives: int = 0) -> Callable[[], None]:
    """One forward + backward of the unrolled loss over a collated batch, as eyas-train's _forward runs it;
    over more than `max_rows` rows, as micro-batches of rows with the whole batch's denominators (the same
    work and gradients, in less memory)."""
    b = {k: v.to(device) for k, v in batch.items() if k not in ("length", "spans")}
    loss_fn = UnrolledLoss(draft, steps, negatives=negatives)
    denom = step_counts(b["loss_mask"], steps, b["segment"])
    rows = b["input_ids"].shape[0]
    parts = [slice(i, i + (max_rows or rows)) for i in range(0, rows, max_rows or rows)]

    def step() -> None:
        for part in parts:
            m = {k: v[part] for k, v in b.items()}
            with autocast(precision, device):
                loss, _ = loss_fn(m["input_ids"], m["aux"], m["target_p"], m["target_top"], m["loss_mask"], denom,
                                  positions=m["positions"], segment=m["segment"])
            loss.backward()
        draft.zero_grad(set_to_none=True)

    return step


def model_flops(cfg: DraftConfig, batch: dict[str, torch.Tensor], steps: int) -> float:
    """Useful model FLOPs of one TTT training step (forward + backward = 3x forward): fc once, the layer at
    every sample token and step, the lm_head at counted rows, attention over each sample's causal keys."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    lengths = batch["length"].double()
    tokens, pairs = float(lengths.sum()), float((lengths * (lengths + 1) / 2).sum())
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    counted = float(step_counts(batch["loss_mask"], steps, batch["segment"]).sum())
    attn = 2 * q * (steps * pairs + tokens * steps * (steps - 1) / 2)  # QK^T and PV: first pass, then the chain
    fc = cfg.num_aux * cfg.target_hidden_size * h
    return 3 * 2 * (tokens * (fc + steps * layer) + counted * h * cfg.draft_vocab_size + attn / 2)


def bench_shape(shape: str, precision: str, negatives: int, ttt: int, a: argparse.Namespace, device: torch.device,
                ) -> dict[str, float]:
    """This shape's cells at each batch in one precision, head loss and TTT depth: useful tokens/s of the TTT
    step packed and padded, and of the bare step packed."""
    draft, out = draft_for(shape, device), {}
    for n in [int(x) for x in a.batches.split(",")]:
        lengths = lengths_for(n, a.min_len, a.max_len, a.seed + n)
        samples = samples_for(draft.cfg, lengths, a.seed)
        for layout in ("packed", "padded"):
            batch = collate(samples, packed=layout == "packed")
            step = train_step(draft, ttt, batch, device, a.max_rows, precision, negatives)
            s, calls = timed(step, a.min_seconds, device)
            out[f"{layout} {n}"] = sum(lengths) / s
            rows, slots = batch["input_ids"].shape
            print(f"  {shape} {precision} head {negatives or 'exact'} TTT {ttt} batch {n} {layout}: {rows} rows x {slots}"
                  f" slots for {sum(lengths)} tokens, {s:.2f} s/step (best of {calls}){peak_memory(device)}",
                  flush=True)
            if layout == "packed":
                s_bare, _ = timed(train_step(draft, 1, batch, device, a.max_rows, precision, negatives), a.min_seconds,
                                  device)
                out[f"bare {n}"] = sum(lengths) / s_bare
                if device.type == "cuda":
                    out[f"mfu {n}"] = model_flops(draft.cfg, batch, ttt) / s / peak_flops(a)
            del batch  # one layout's teacher probabilities in memory at a time
    return out


def peak_memory(device: torch.device) -> str:
    """The GPU memory the cells so far peaked at (the allocator's pool, not the process's)."""
    if device.type != "cuda":
        return ""
    return f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"


def peak_flops(a: argparse.Namespace) -> float:
    name = torch.cuda.get_device_name()
    peak = a.peak_tflops * 1e12 if a.peak_tflops else next((v for k, v in PEAKS.items() if k in name), None)
    return peak or math.nan


def report(results: dict[tuple[str, str, int, int], dict[str, float]], a: argparse.Namespace) -> None:
    batches, gpu = [int(x) for x in a.batches.split(",")], torch.cuda.is_available()
    cell = f" {{:>9}} {{:>8}} {{:>5}} {{:>9}} {{:>{8 if gpu else 0}}} |"
    print(f"{'':<12} {'':>5} {'':>7} {'':>5} {'':>5} {'':>3} |"
          + "".join(cell.format(f"batch {n}", "", "", "", "") for n in batches))
    print(f"{'shape':<12} {'H':>5} {'draft V':>7} {'prec':>5} {'head':>5} {'TTT':>3} |"
          + cell.format("packed", "padded", "x", "TTT/bare", "MFU" if gpu else "") * len(batches))
    for (shape, precision, negatives, steps), r in results.items():
        line = (f"{shape:<12} {SHAPES[shape][0]:>5} {SHAPES[shape][-1]:>7} {precision:>5} {negatives or 'exact':>5}"
                f" {steps:>3} |")
        for n in batches:
            packed, padded, bare = r[f"packed {n}"], r[f"padded {n}"], r[f"bare {n}"]
            line += cell.format(f"{packed:,.0f}", f"{padded:,.0f}", f"{packed / padded:.2f}",
                                f"{steps * packed / bare:.2f}", f"{r[f'mfu {n}']:.1%}" if gpu else "")
        print(line, flush=True)


def main() -> None:
    a = args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.threads:
        torch.set_num_threads(a.threads)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {where}; sample lengths log-uniform {a.min_len}-{a.max_len} "
          f"(seed {a.seed}); useful (non-padding) tokens/s, forward + backward", flush=True)
    t0 = time.perf_counter()
    variants = [tuple(int(x) for x in v.split(":")) for v in a.steps.split(",")]
    results = {(shape, precision, neg, ttt): bench_shape(shape, precision, neg, ttt, a, device)
               for shape in a.shapes.split(",") for precision in a.precision.split(",") for neg, ttt in variants}
    print(f"\n{time.perf_counter() - t0:.0f} s. Useful tokens/s of a TTT step packed and padded; x: packed over padded "
          f"(goal >= 1.5 at the large batch); TTT/bare: TTT tokens/s over bare tokens/s (packed) times "
          f"the TTT steps, i.e. against the 1/TTT ideal (goal >= 0.9); head: exact, or --head-negatives")
    report(results, a)


if __name__ == "__main__":
    main()
