"""Samples -> shards -> batches, all deterministic from the synth dataset and the params.

The samples come indexed by eyas_common.samples (index_samples: id, sizes and where each line is).

Shards: samples sorted by id, cut greedily into shards of at most `shard_samples` samples and
`shard_tokens` tokens (a longer sample gets a shard of its own); shard j belongs to worker j mod W.
So resume and `--shard i/N` find the same shards, and a shard's batches (below) are always the same.
Batches: a shard's samples sorted by length, longest first, cut so that batch size x longest
sample <= `batch_tokens`: the padded batch never exceeds the budget, and neighbours in length
order pad little.
"""

from __future__ import annotations

from eyas_common.samples import SampleLine


def plan_shards(refs: list[SampleLine], shard_samples: int, shard_tokens: int) -> list[list[SampleLine]]:
    shards: list[list[SampleLine]] = []
    cur: list[SampleLine] = []
    tokens = 0
    for r in refs:
        if cur and (len(cur) >= shard_samples or tokens + r.n_tokens > shard_tokens):
            shards.append(cur)
            cur, tokens = [], 0
        cur.append(r)
        tokens += r.n_tokens
    if cur:
        shards.append(cur)
    return shards


def make_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, grouped: longest first, batch size x longest <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    batches: list[list[int]] = []
    for k in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(k)
        else:
            batches.append([k])
    return batches
