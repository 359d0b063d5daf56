"""`--order shards` and `--follow`: training that takes the hidden dataset shard by shard, as it is written.

With `--order shards` the first pass walks the shards in order, a window of W shards at a time
(`--window-shards`), each window's training samples in a seeded permutation, cut into global batches of
B consecutive samples (a batch may straddle two windows; the tail that fills no batch is dropped). Every
later pass, when the recipe asks for one, is an epoch of seeded batches over the whole dataset, as with
`--order random`. So step s needs only the shards up to its window, and `--follow` trains while
`eyas-extract run --follow` still writes: it waits for a window's shards to be listed as final.

What the random order reads from the whole dataset is taken from the first window instead, so that a
followed run and an offline one over the finished dataset make the same decisions, hence the same draft:
    validation   the V samples of the first window whose hashed sample ids come first (recipe.split_by_sample)
    recipe       batch, lr and steps resolved from the first window's tokens per sample and from the
                 expected sample count N (the synth dataset's asked count)
    vocabulary   the most frequent loss-masked tokens of the first window
The run takes `total_steps` from that recipe: if fewer samples arrive than expected, later passes fill up
the steps; if more arrive, the first pass is longer and the schedule ends before it does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from eyas_common.contract import Dataset, DatasetError
from eyas_common.hidden import HiddenShards, budget_wait, shard_bytes, size_text
from eyas_common.lock import WRITER_GRACE_S, WriterWatch, describe

WAIT_LOG_S = 30.0  # a "waiting for" line is printed at most this often


def expected_samples(hidden_ds: Dataset, hidden_m: dict[str, Any]) -> int:
    """N: the samples the hidden dataset will hold. The synth dataset's asked count (`params.n`) when it has
    one, else its kept count once complete, else the hidden dataset's own count once complete."""
    for entry in hidden_m.get("inputs") or []:
        ref = entry.get("ref", "") if isinstance(entry, dict) else ""
        if ref.startswith("synth/"):
            sds = Dataset.parse(ref, "synth", hidden_ds.root)
            m = sds.read_manifest() if sds.manifest_path.exists() else {}
            asked = (m.get("params") or {}).get("n")
            if isinstance(asked, int) and asked > 0:
                return asked
            if m.get("status") == "complete":
                return int((m.get("stats") or {}).get("samples", 0))
    if hidden_m.get("status") == "complete":
        return int((hidden_m.get("stats") or {}).get("samples", 0)) or _count(hidden_ds, hidden_m)
    raise DatasetError(f"{hidden_ds.ref}: how many samples it will hold is unknown (no synth input with an asked "
                       f"count); train it with --order random once it is complete")


def _count(hidden_ds: Dataset, hidden_m: dict[str, Any]) -> int:
    return len(HiddenShards(hidden_ds, hidden_m))


def wait_for_shards(shards: HiddenShards, upto: int, *, poll_s: float, say: Callable[[str], None],
                    stuck: Callable[[int], None] | None = None) -> int:
    """Block until the first `upto` shards are listed, or the dataset is complete with fewer; the number of
    shards there. A dataset left partial with no eyas-extract run writing it stops the wait in one line, and
    so does `stuck(upto)` (asked at every poll) when the writer waits on this run in turn."""
    said_at, watch = -WAIT_LOG_S, WriterWatch()
    while len(shards.files) < upto and not shards.complete:
        if shards.grow():
            continue
        if shards.complete:
            break
        if watch.gone(shards.writer):
            raise DatasetError(f"{shards.ds.ref} stopped partial (no eyas-extract run is writing it) after "
                               f"{len(shards.files)} shards; resume it with the same `eyas-extract run --follow` "
                               f"command (make extract FOLLOW=1), then rerun this one to resume")
        if stuck is not None:
            stuck(upto)
        if time.monotonic() - said_at >= WAIT_LOG_S:
            say(f"waiting for {shards.ds.ref}: {len(shards.files)} shards final ({len(shards.samples)} samples), "
                f"the next step needs shard {upto - 1}; written by {describe(shards.writer)}" if shards.writer else
                f"waiting for {shards.ds.ref}: no eyas-extract run writes it; waiting {WRITER_GRACE_S:.0f} s for one")
            said_at = time.monotonic()
        time.sleep(poll_s)
    return min(upto, len(shards.files))


def extract_blocked(shards: HiddenShards, upto: int) -> tuple[dict[str, Any], int] | None:
    """(its wait, bytes of shards on disk) when the extract run writing `shards` waits, under its --disk-budget
    (hidden.mark_budget_wait), for room that the shards on disk leave it no room for now, to make a shard
    among the first `upto` (those the reader waits for); else None."""
    wait = budget_wait(shards.manifest, shards.writer)
    if wait is None or wait["shard"] >= upto:  # the shards before it are coming
        return None
    held = shard_bytes(shards.ds)
    return None if held == 0 or held + wait["bytes"] <= wait["budget"] else (wait, held)


def largest_shard(shards: HiddenShards, wait: dict[str, Any]) -> int:
    """The bytes of the largest shard listed so far or waited for (later ones are guessed no larger)."""
    listed = [e["bytes"] for e in shards.manifest.get("files") or [] if e["name"].startswith("shard-")]
    return max([wait["bytes"], *listed])


def deadlock_error(shards: HiddenShards, wait: dict[str, Any], held: int, *, fix: str) -> DatasetError:
    """[STREAM_DEADLOCK]: extract waits for room under its --disk-budget that only this run could free, and this
    run waits for its shards; `fix`: the size that works. The why: stages/03_train/README.md."""
    return DatasetError(f"{shards.ds.ref}: --disk-budget {size_text(wait['budget'])} deadlocks extract and "
                        f"training; {fix} (stages/03_train/README.md)", code="STREAM_DEADLOCK", names=shards.ds.ref)


def first_window(shards: HiddenShards, window: int, n_val: int) -> range:
    """The sample indices of the first window, refused when they cannot hold the validation slice."""
    n_shards = min(window, len(shards.files))
    samples = range(shards.shard_starts[n_shards])
    if len(samples) <= n_val:
        raise DatasetError(f"{shards.ds.ref}: --order shards holds out its {n_val} validation samples from the "
                           f"first {n_shards} shards, which hold {len(samples)}: raise --window-shards or lower "
                           f"--val-samples")
    return samples


def stream_batches(shards: HiddenShards, *, window: int, val: set[int], batch_size: int, seed: int,
                   wait: Callable[[int], int]) -> Iterator[tuple[list[int], int, set[int]] | None]:
    """The first pass's global batches (sample indices), each as soon as `wait` has its window's shards, with
    --consume's bookkeeping: the shards taken in so far, and those of them holding a training sample not dealt
    yet (the < B samples carried into the next window: every other shard taken is dealt in full).
    None comes before a wait for shards not taken yet: the reader ahead (data.prefetch) hands out the batch
    it holds instead of sitting on it through the wait."""
    buf: list[int] = []
    w = 0
    while True:
        if len(shards.files) < (w + 1) * window and not shards.complete:
            yield None
        there = wait((w + 1) * window)
        if there <= w * window:
            return
        idx = [i for i in range(shards.shard_starts[w * window], shards.shard_starts[there]) if i not in val]
        perm = torch.randperm(len(idx), generator=torch.Generator().manual_seed(seed * 100003 + 50021 + w))
        buf += [idx[j] for j in perm.tolist()]
        while len(buf) >= batch_size:
            batch, buf = buf[:batch_size], buf[batch_size:]
            yield batch, there, {shards.samples[i].shard for i in buf}
        if there < (w + 1) * window:
            return
        w += 1


class Consumption:
    """--consume: which shards the first pass has used for the last time. A shard goes once every training
    sample of it is dealt, the last step using it is done and saved in a checkpoint, and it holds no
    validation sample (those shards, and everything when the recipe takes more than one pass, go at the end)."""

    def __init__(self, shards: HiddenShards, val: list[int]):
        self.shards = shards
        self.keep = {shards.samples[i].shard for i in val}
        self.last_use: dict[int, int] = {}  # shard -> the last step (0-based) whose batch holds a sample of it
        self.taken = 0                      # shards [0, taken) are in the windows dealt from so far
        self.carried: set[int] = set()      # ... and these of them hold a training sample not dealt yet
        self.done: set[int] = set()         # consumed, by this run or an earlier session of it

    def dealt_batch(self, step: int, batch: list[int], taken: int, carried: set[int]) -> None:
        for i in batch:
            self.last_use[self.shards.samples[i].shard] = step
        self.taken, self.carried = taken, carried

    def all_dealt(self) -> None:
        """The data is complete: what no batch took is past its last use too."""
        self.taken, self.carried = len(self.shards.files), set()

    def due(self, steps_done: int) -> list[int]:
        """Shards whose every use is among the first `steps_done` steps (saved in a checkpoint now)."""
        return [j for j in range(self.taken) if j not in self.keep and j not in self.done
                and j not in self.carried and self.last_use.get(j, -1) < steps_done]
