"""Cutting a hidden dataset into deterministic global batches, and reading them ahead of the step.

The shards themselves are read through eyas_common.hidden (the format's one owner), which opens
exactly the files the manifest lists. Shards are memory-mapped and a sample is sliced out when its
batch is built, so a dataset far larger than memory trains the same way.

Which samples make a step never depends on how they are laid out: `global_batches` fixes them (the
same for any number of processes), `rank_share` deals them to ranks, and only then does `collate` lay a
rank's share into rows, packed end to end (`--batching packed`, the default: no padding computed but
the tail of a row) or one right-padded sample per row (`--batching padded`); ttt.py keeps packed
samples apart, so both give the same loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from eyas_common.contract import Dataset, DatasetError
from eyas_common.hidden import HiddenShards, SampleRef
from eyas_train.vocab import count_tokens


def token_counts(shards: HiddenShards, vocab_size: int, n_shards: int | None = None) -> torch.Tensor:
    """Loss-masked token counts over the whole dataset (its first `n_shards` shards), one shard at a time."""
    total = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in shards.token_columns(n_shards):
        total += count_tokens(ids, mask, vocab_size)
    return total


def kept_targets(shards: HiddenShards, max_len: int) -> int:
    """Loss-masked tokens left inside the first `max_len` rows of the samples (past the first two rows: the first
    token a draft predicts is x_2). Counted only when --max-len cuts some sample; 1 when it cuts none."""
    if max_len >= max((x.length for x in shards.samples), default=0):
        return 1
    by_shard: dict[int, list[SampleRef]] = {}
    for x in shards.samples:
        by_shard.setdefault(x.shard, []).append(x)
    kept = 0
    for i, (_, mask) in enumerate(shards.token_columns(max(by_shard) + 1)):
        kept += sum(int(mask[x.start + 2:x.start + min(x.length, max_len)].sum()) for x in by_shard.get(i, []))
    return kept


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s global batches of sample indices: a seeded permutation, the incomplete tail dropped
    (the same seed and epoch give the same batches whatever the number of processes)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def rank_share(batch: list[int], lengths: list[int], rank: int, world: int) -> list[int]:
    """This rank's samples of a global batch: sorted by length and dealt round-robin, so ranks get about
    the same tokens (and, padded, pad alike)."""
    ordered = sorted(batch, key=lambda i: (lengths[i], i))
    return ordered[rank::world]


def row_plan(lengths: list[int], packed: bool) -> list[list[int]]:
    """Which samples (indices into `lengths`) each batch row holds, in order. Packed: first-fit decreasing
    into rows as long as the longest sample (a sample is never split; rows end in what padding is left);
    padded: one sample per row."""
    if not packed:
        return [[i] for i in range(len(lengths))]
    width = max(lengths)
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(width)
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def collate(samples: list[dict[str, torch.Tensor]], packed: bool = False) -> dict[str, torch.Tensor]:
    """Samples laid into [R, T, ...] rows (row_plan), zeros after each row's last sample (loss_mask 0
    there). Adds what the unrolled loss needs to keep samples apart (ttt.py): `segment` [R, T] (1 + the
    sample's index, 0 on padding) and `positions` [R, T] (within the sample); and, per sample in input
    order, `length` [n] and `spans` [n, 3] (row, first slot, length)."""
    lengths = [s["input_ids"].shape[0] for s in samples]
    plan = row_plan(lengths, packed)
    shape = (len(plan), max(lengths))
    out = {k: torch.zeros((*shape, *v.shape[1:]), dtype=v.dtype) for k, v in samples[0].items()}
    out["segment"] = torch.zeros(shape, dtype=torch.long)
    out["positions"] = torch.zeros(shape, dtype=torch.long)
    spans = torch.zeros((len(samples), 3), dtype=torch.long)
    for r, members in enumerate(plan):
        start = 0
        for i in members:
            n = lengths[i]
            for k, v in samples[i].items():
                out[k][r, start:start + n] = v
            out["segment"][r, start:start + n] = i + 1
            out["positions"][r, start:start + n] = torch.arange(n)
            spans[i] = torch.tensor([r, start, n])
            start += n
    out["input_ids"] = out["input_ids"].long()
    out["length"], out["spans"] = torch.tensor(lengths), spans
    return out


def per_sample(x: torch.Tensor, spans: torch.Tensor) -> list[torch.Tensor]:
    """A collated [R, T, ...] tensor cut back into its samples (input order), padding dropped."""
    return [x[r, start:start + n] for r, start, n in spans.tolist()]


def prefetch(shards: HiddenShards, plan: Iterator[list[int] | None], max_len: int,
             packed: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Collated batches for the planned sample lists, the next one read in a background thread. A None in
    the plan says that the plan may now wait (for shards still being written): the batch read ahead is
    handed out first."""
    def load(idx: list[int]) -> dict[str, torch.Tensor]:
        return collate([shards.read(shards.samples[i], max_len) for i in idx], packed)

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for idx in plan:
            if idx is None:
                if pending is not None:
                    yield pending.result()
                pending = None
                continue
            fut = pool.submit(load, idx)
            if pending is not None:
                yield pending.result()
            pending = fut
        if pending is not None:
            yield pending.result()


def refuse_no_targets(hidden_ds: Dataset, shards: HiddenShards, max_len: int) -> None:
    """Refuse a --max-len that cuts every sample before its completion starts: the draft would learn nothing."""
    if not kept_targets(shards, max_len):
        raise DatasetError(f"--max-len {max_len} keeps no completion token of {hidden_ds.ref} (the samples' first "
                           f"{max_len} tokens are all prompt), so the draft would learn nothing: raise it (its samples "
                           f"are up to {max(x.length for x in shards.samples)} tokens long)")
