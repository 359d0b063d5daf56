"""The training recipe resolved from the data: batch, peak learning rate, length, warm-up, validation.

Every value below is what `eyas-train run` uses when its option is left unset; an option that is set
wins. The reasoning and the measurements behind the constants are in stages/03_train/README.md.

    L  = mean tokens per training sample (after --max-len)       N = training samples
    batch      B = the largest batch <= batch_tokens / L samples that still gives min_steps optimiser
                   steps within max_epochs (small data: small batches, so it gets enough updates), but
                   never under TOKENS_REF / L samples (below that, steps get noisier faster than they
                   get more numerous: measured, see the README)
    epochs     E = ceil(token_budget / (N L)), within [1, max_epochs], raised until E * (N // B) >= min_steps
                   when max_epochs allows (large data: about the token budget, at least one pass)
    lr           = 3e-3 * (128 / H) * min(1, sqrt(B L / 256)), H the draft width: the fixture's tuned
                   3e-3 (H 128, ~280 tokens a step); Adam's square-root rule below 256 tokens a step;
                   1/width above (muP's rule for Adam), which gives the peers' 1e-4 at H 4096
    warm-up      = 3% of the steps, at most 500 steps
    validation   = N_all // 20 samples, at least min(32, N_all // 8), at most 1000, held out by sample id
    head         = sampled (SAMPLED_NEGATIVES drawn columns) on a draft vocabulary of SAMPLED_FROM tokens or more,
                   else exact: below that the chunk's teacher tokens cover much of the vocabulary anyway
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Recipe:
    batch_size: int         # samples per optimiser step, over all processes
    epochs: float           # passes over the training samples (total_steps / steps_per_epoch)
    steps_per_epoch: int
    total_steps: int
    lr: float               # AdamW peak learning rate
    warmup_steps: int       # linear warm-up, then cosine decay to 0 at total_steps
    train_samples: int
    val_samples: int
    tokens_per_sample: float
    eval_every: int         # optimiser steps between validations (0: no validation)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def val_count(n: int, requested: int | None, world: int) -> int:
    """Held-out samples: the requested number, or n // 20 within [min(32, n // 8), 1000]; a multiple of
    the process count so that every rank validates the same number of batches."""
    v = requested if requested is not None else min(1000, max(n // 20, min(32, n // 8)))
    if v >= n:
        raise ValueError(f"--val-samples {v} leaves no training sample of {n}: hold out fewer")
    return v - v % world


def split_by_sample(sample_ids: list[int], n_val: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, validation indices) into `sample_ids`: the validation slice is the n_val
    samples whose hashed sample id comes first, so it depends on the ids, not on shard layout or order."""
    def rank(i: int) -> bytes:
        return hashlib.sha256(f"eyas-val:{seed}:{sample_ids[i]}".encode()).digest()

    order = sorted(range(len(sample_ids)), key=rank)
    val = sorted(order[:n_val])
    held = set(val)
    return [i for i in range(len(sample_ids)) if i not in held], val


# The learning-rate anchor: the fixture recipe's peak (3e-3) for a 128-wide draft at the tokens a step it was
# tuned at (4 samples of ~71 tokens: ~280, rounded down to 256).
LR_REF, WIDTH_REF, TOKENS_REF = 3e-3, 128, 256


def resolve(cfg: Any, *, lengths: list[int], n_val: int, width: int, world: int, n: int | None = None) -> Recipe:
    """The recipe for training on samples of these kept `lengths` (the training slice) with `cfg`
    (a TrainConfig: None means "from the rule"); `n`: the training samples when `lengths` are only the
    first of them (--order shards), else len(lengths)."""
    n = len(lengths) if n is None else n
    per_sample = sum(lengths) / max(1, len(lengths))  # with `n` given: the first window's mean
    batch = cfg.batch_size or _batch(n, per_sample, cfg)
    batch = world * math.ceil(batch / world)
    per_epoch = n // batch
    if per_epoch == 0:
        raise ValueError(f"{n} training samples are fewer than one batch of {batch}: lower --batch-size "
                         f"(or --val-samples)")
    if cfg.epochs is not None:
        total = int(round(cfg.epochs * per_epoch))
        if cfg.epochs > 0 and total == 0:
            raise ValueError(f"--epochs {cfg.epochs:g} is {cfg.epochs * per_epoch:.2g} of the {per_epoch} steps a pass "
                             f"(batch {batch}): it rounds to no step at all; pass at least --epochs "
                             f"{1 / per_epoch:.3g} (one step), or 0 to export the untrained draft")
    else:
        total = _steps(n, per_sample, per_epoch, cfg)
    lr = cfg.lr if cfg.lr is not None else peak_lr(batch * per_sample, width)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(500, math.ceil(0.03 * total))
    every = 0 if n_val == 0 else (cfg.eval_every or max(1, total // 20))
    return Recipe(batch_size=batch, epochs=round(total / per_epoch, 3), steps_per_epoch=per_epoch,
                  total_steps=total, lr=lr, warmup_steps=warmup, train_samples=n, val_samples=n_val,
                  tokens_per_sample=round(per_sample, 1), eval_every=every)


def _batch(n: int, per_sample: float, cfg: Any) -> int:
    by_tokens = max(1, int(cfg.batch_tokens // max(1.0, per_sample)))
    by_steps = max(1, n * cfg.max_epochs // cfg.min_steps)  # min_steps still fit in max_epochs
    floor = math.ceil(TOKENS_REF / max(1.0, per_sample))  # the lr anchor's tokens a step
    return max(1, min(n, max(floor, min(by_tokens, by_steps))))


def _steps(n: int, per_sample: float, per_epoch: int, cfg: Any) -> int:
    epochs = min(cfg.max_epochs, max(1, math.ceil(cfg.token_budget / max(1.0, n * per_sample))))
    floor = min(cfg.max_epochs * per_epoch, cfg.min_steps)  # the step floor, as far as max_epochs allows
    return max(epochs * per_epoch, floor)


# The sampled head's default (bench/RESULTS.md, "A cheaper step"): at a 32,000-token draft vocabulary it made the
# step 1.97x faster at the same acceptance; on the fixture's 3,000 it saved little.
SAMPLED_NEGATIVES, SAMPLED_FROM = 256, 8192


def head_negatives(requested: int | None, draft_vocab: int) -> int:
    """--head-negatives as set, else SAMPLED_NEGATIVES on a draft vocabulary of SAMPLED_FROM or more, else 0."""
    if requested is not None:
        return requested
    return SAMPLED_NEGATIVES if draft_vocab >= SAMPLED_FROM else 0


def peak_lr(batch_tokens: float, width: int) -> float:
    """Peak AdamW learning rate for a draft `width` wide taking `batch_tokens` tokens a step."""
    return LR_REF * (WIDTH_REF / width) * min(1.0, math.sqrt(batch_tokens / TOKENS_REF))


def lr_lambda(total: int, warmup_steps: int):
    """Linear warm-up over `warmup_steps`, then cosine decay to 0 at `total`."""
    w = max(1, warmup_steps)

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))

    return f


def predicted_acceptance(step_acc: list[float], spec_tokens: int) -> float:
    """Acceptance length from per-step TTT accuracies: 1 + a0 + a0 a1 + ... (k terms). Step k's accuracy
    is measured with the true earlier tokens, i.e. given that the draft's earlier proposals were right,
    which is when a chain verification reaches position k."""
    total, chain = 1.0, 1.0
    for a in step_acc[:spec_tokens]:
        chain *= a
        total += chain
    return total


def replay_acceptance(lead: list[int], loss_mask: list[int], spec_tokens: int) -> tuple[int, int]:
    """(drafts, accepted tokens) of greedy chain speculation over one sample whose target tokens are known,
    as vLLM would count them: `lead[t]` is how many of the chain's proposals from root t are right
    (UnrolledLoss's `leads`). Every completion span (a run of loss_mask 1 starting at p) is decoded from root
    p - 1; a root that accepts m proposals is followed by root t + m + 1 (m accepted, one from the target).

    Unlike the chain product, this visits the roots a decoder visits: after a rejection it drafts again
    at the very next token, so hard stretches are drafted from more often than easy ones and the mean
    acceptance is lower than the average over all rows."""
    drafts = accepted = 0
    n = len(loss_mask)
    for p in range(1, n):
        if not (loss_mask[p] and not loss_mask[p - 1]):
            continue
        t = p - 1
        while t + 2 < n and loss_mask[t + 2]:
            m = min(lead[t], spec_tokens)
            drafts += 1
            accepted += m
            t += m + 1
    return drafts, accepted
