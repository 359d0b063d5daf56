"""Cutting a hidden dataset into deterministic global batches, and reading them ahead of the step.

The shards themselves are read through eyas_common.hidden (the format's one owner), which opens
exactly the files the manifest lists. Shards are memory-mapped and a sample is sliced out when its
batch is built, so a dataset far larger than memory trains the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from eyas_common.hidden import HiddenShards
from eyas_train.vocab import count_tokens


def token_counts(shards: HiddenShards, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts over the whole dataset, one shard at a time."""
    total = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in shards.token_columns():
        total += count_tokens(ids, mask, vocab_size)
    return total


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s global batches of sample indices: a seeded permutation, the incomplete tail dropped
    (the same seed and epoch give the same batches whatever the number of processes)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def rank_share(batch: list[int], lengths: list[int], rank: int, world: int) -> list[int]:
    """This rank's samples of a global batch: sorted by length and dealt round-robin, so ranks pad alike."""
    ordered = sorted(batch, key=lambda i: (lengths[i], i))
    return ordered[rank::world]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad samples to [B, T_max, ...]; padding is zeros (loss_mask 0 there)."""
    t = max(r["input_ids"].shape[0] for r in rows)
    out = {}
    for k in rows[0]:
        first = rows[0][k]
        buf = torch.zeros((len(rows), t, *first.shape[1:]), dtype=first.dtype)
        for i, r in enumerate(rows):
            buf[i, : r[k].shape[0]] = r[k]
        out[k] = buf
    out["input_ids"] = out["input_ids"].long()
    out["length"] = torch.tensor([r["input_ids"].shape[0] for r in rows])
    return out


def prefetch(shards: HiddenShards, plan: Iterator[list[int]], max_len: int) -> Iterator[dict[str, torch.Tensor]]:
    """Collated batches for the planned sample lists, the next one read in a background thread."""
    def load(idx: list[int]) -> dict[str, torch.Tensor]:
        return collate([shards.read(shards.samples[i], max_len) for i in idx])

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for idx in plan:
            fut = pool.submit(load, idx)
            if pending is not None:
                yield pending.result()
            pending = fut
        if pending is not None:
            yield pending.result()
