"""Samples -> shards -> batches, all deterministic from the synth dataset and the params.

Shards: samples sorted by id, cut greedily into shards of at most `shard_samples` samples and
`shard_tokens` tokens (a longer sample gets a shard of its own); shard j belongs to worker j mod W.
So resume and `--shard i/N` find the same shards, and a shard's batches (below) are always the same.
Batches: a shard's samples sorted by length, longest first, cut so that batch size x longest
sample <= `batch_tokens`: the padded batch never exceeds the budget, and neighbours in length
order pad little.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eyas_common.contract import DatasetError


@dataclass(frozen=True)
class SynthLine:
    id: int
    n_tokens: int
    n_masked: int
    pos: int  # byte offset of its line in samples.jsonl


def index_samples(path: Path, vocab_size: int) -> list[SynthLine]:
    """Read and check every sample once, keeping only where it is: the tokens are re-read per shard."""
    refs: list[SynthLine] = []
    seen: set[int] = set()
    with open(path, "rb") as f:
        pos = 0
        for lineno, line in enumerate(f, 1):
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: malformed JSON record ({e.msg}); the synth dataset is corrupted: "
                                   f"check it with `eyas-data verify`, then remake it with eyas-synth run") from None
            ids, mask, sid = rec.get("input_ids"), rec.get("loss_mask"), rec.get("id")
            problem = None
            if not isinstance(sid, int) or not isinstance(ids, list) or not isinstance(mask, list):
                problem = "fields id, input_ids and loss_mask missing or of the wrong type"
            elif not ids or len(ids) != len(mask):
                problem = f"{len(ids)} input_ids but {len(mask)} loss_mask values"
            elif not (isinstance(min(ids), int) and min(ids) >= 0 and max(ids) < vocab_size):
                problem = f"input_ids outside the target's vocabulary [0, {vocab_size})"
            elif not set(mask) <= {0, 1}:
                problem = "loss_mask values other than 0/1"
            elif sid in seen:
                problem = f"sample id {sid} appears twice"
            if problem:
                raise DatasetError(f"{where}: {problem}; the synth dataset is invalid: run `eyas-synth validate` "
                                   f"on it and remake it with eyas-synth run")
            seen.add(sid)
            refs.append(SynthLine(sid, len(ids), sum(mask), start))
    if not refs:
        raise DatasetError(f"{path}: no samples; remake the synth dataset with eyas-synth run")
    return sorted(refs, key=lambda r: r.id)


def load_tokens(path: Path, refs: list[SynthLine]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each sample, read at its recorded offset."""
    out = []
    with open(path, "rb") as f:
        for r in refs:
            f.seek(r.pos)
            rec = json.loads(f.readline())
            if rec.get("id") != r.id:
                raise DatasetError(f"{path}: changed while being read (sample {r.id} moved); rerun")
            out.append((rec["input_ids"], rec["loss_mask"]))
    return out


def plan_shards(refs: list[SynthLine], shard_samples: int, shard_tokens: int) -> list[list[SynthLine]]:
    shards: list[list[SynthLine]] = []
    cur: list[SynthLine] = []
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
