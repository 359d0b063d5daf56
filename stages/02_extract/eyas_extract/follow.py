"""`eyas-extract run --follow`: extract a synth dataset while eyas-synth is still writing it.

Shards are cut as an offline run cuts them (batching.plan_shards: samples sorted by id, cut greedily),
and a greedy cut is prefix-stable: a shard's content depends only on the samples up to its end and on
the one after it. So a shard is final, and extracted, once every id up to the first sample past it is
decided (samples.SynthTail: kept, set aside or rejected), or once it is full, or once synth is complete.
The shards are then, byte for byte, those an offline extraction of the finished dataset writes.

While it runs the hidden manifest stays partial and lists in `files` each shard once it is final
(name, bytes, sha256, records, first_id, last_id), so a reader can follow it in turn. One process writes
that list, so --follow runs as one worker. It ends when synth is complete and every shard is extracted
(the run then finalizes as any run does), or, when synth stopped partial (no process holds its writer
lock), once what is decided is extracted, with one line saying what to run.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from eyas_common.contract import Dataset, DatasetError, input_ref, sha256_file
from eyas_common.hidden import (consumer_alive, consumer_error, count_shard, finished_consumer, made_shards, mark_budget_wait, open_shard,
                                shard_bytes, shard_name, update_manifest)
from eyas_common.lock import WRITER_GRACE_S, WriterWatch, describe
from eyas_common.samples import SampleLine, SynthTail

from eyas_extract.batching import plan_shards

WAIT_LOG_S = 30.0  # a changed "waiting for" line is printed at most this often
SHARD_GLOB = "shard-*.safetensors"


class ShardCutter:
    """Cuts samples, handed over in id order, into the shards an offline run cuts, each once it is final."""

    def __init__(self, *, shard_samples: int, shard_tokens: int):
        self.shard_samples, self.shard_tokens = shard_samples, shard_tokens
        self.pending: list[SampleLine] = []  # samples after the last final shard

    def cut(self, ready: list[SampleLine], *, complete: bool) -> list[list[SampleLine]]:
        """The shards made final by `ready` (the next samples in id order); `complete`: no sample follows."""
        self.pending += ready
        shards = plan_shards(self.pending, self.shard_samples, self.shard_tokens)
        # Every shard but the last was cut by a sample already here. The last one is final only when full:
        # otherwise a sample yet to come may join it.
        if shards and not complete and len(shards[-1]) < self.shard_samples:
            shards.pop()
        self.pending = self.pending[sum(map(len, shards)):]
        return shards


class Follower:
    """A synth dataset being written, cut into final shards as it grows."""

    def __init__(self, sds: Dataset, *, vocab_size: int, shard_samples: int, shard_tokens: int, poll_s: float):
        self.tail = SynthTail(sds, vocab_size)
        self.cutter = ShardCutter(shard_samples=shard_samples, shard_tokens=shard_tokens)
        self.poll_s = poll_s
        self.tail.poll()

    def new_shards(self) -> list[list[SampleLine]]:
        return self.cutter.cut(self.tail.take_ready(), complete=self.tail.complete)

    def run(self, plan: list[list[SampleLine]], extract: Callable[[list[int]], None], *, ds: Dataset,
            say: Callable[[str], None]) -> None:
        """Extract shards as they become final, appending them to `plan`, until synth is complete and every
        shard is extracted; raise once what is decided is extracted when synth stopped partial."""
        last, said_at, watch = "", -WAIT_LOG_S, WriterWatch()
        while True:
            if new := self.new_shards():
                plan += new
                extract(list(range(len(plan) - len(new), len(plan))))
            if self.tail.complete:
                return
            if watch.gone(self.tail.writer):
                raise DatasetError(self.stopped_line(ds, len(plan)))
            line = self.waiting_line(len(plan))
            if line != last and time.monotonic() - said_at >= WAIT_LOG_S:
                say(line)
                last, said_at = line, time.monotonic()
            time.sleep(self.poll_s)
            self.tail.poll()

    def waiting_line(self, extracted: int) -> str:
        tail = self.tail
        asked = (tail.manifest.get("params") or {}).get("n", "?")
        return (f"waiting for {tail.ds.ref}: {tail.n_decided} of {asked} ids decided ({len(tail.seen)} samples), "
                f"{extracted} shards extracted; the next shard waits for id {tail.prefix}"
                + ("" if tail.writer else f"; no eyas-synth run writes it: waiting {WRITER_GRACE_S:.0f} s for one"))

    def stopped_line(self, ds: Dataset, extracted: int) -> str:
        sref = self.tail.ds.ref
        return (f"{sref} stopped partial (no eyas-synth run is writing it): ids below {self.tail.prefix} are "
                f"decided and their {extracted} shards are in {ds.ref}; resume it with the same eyas-synth command "
                f"(or accept its shortfall with --allow-missing), then rerun this one")


class ConsumerDone(Exception):
    """--disk-budget: the training run consuming the dataset is over; the shards still to make have no reader."""

    def __init__(self, draft: str, shard: int):
        super().__init__(draft)
        self.draft, self.shard = draft, shard


def wait_for_budget(ds: Dataset, manifest: dict[str, Any], budget: int, shard: int, next_bytes: int, *,
                    poll_s: float, say: Callable[[str], None], grace_s: float = 600.0) -> None:
    """--disk-budget: before shard `shard` (`next_bytes`) is made, wait while the shards on disk would exceed
    `budget` with it (training with `eyas-train run --follow --consume` deletes them; one shard always goes).
    The wait is marked in the manifest while it lasts: a training run waiting for this very shard then knows
    that the two wait on each other (a budget too small for its window) and stops with the fix. Once that run
    is over (it stopped early, or its schedule ended before the data), ConsumerDone: nobody would read on."""
    said_at, marked, absent_since = -WAIT_LOG_S, False, None
    while True:
        if (draft := finished_consumer(ds)) is not None:
            mark_budget_wait(ds, manifest, None)
            raise ConsumerDone(draft, shard)
        held = shard_bytes(ds)
        if held == 0 or held + next_bytes <= budget:
            if marked:
                mark_budget_wait(ds, manifest, None)
            return
        if not marked:
            mark_budget_wait(ds, manifest, {"budget": budget, "shard": shard, "bytes": next_bytes,
                                            "pid": os.getpid(), "host": socket.gethostname()})
            marked = True
        alive = consumer_alive(ds)
        absent_since = None if alive else (absent_since or time.monotonic())
        last = consumer_error(ds)
        why = f" (its last: {_short(last['error'])})" if last and last.get("error") else ""
        if absent_since is not None and time.monotonic() - absent_since >= grace_s:
            mark_budget_wait(ds, manifest, None)
            raise DatasetError(f"{ds.ref}: no training run consumed it for {grace_s:g}s{why}; start "
                               f"`eyas-train run --follow --consume`, then rerun this extract", code="NO_CONSUMER",
                               names=ds.ref)
        if time.monotonic() - said_at >= WAIT_LOG_S:
            who = (f"no training run holds the consumer lock{why} (stopping after --consumer-grace {grace_s:g}s)"
                   if alive is None else f"consumer: {describe(alive)}")
            say(f"waiting for training to consume shards: {held / 1e6:,.1f} MB of {ds.ref} shards on disk + "
                f"{next_bytes / 1e6:,.1f} MB for the next > --disk-budget {budget / 1e6:,.1f} MB; {who}")
            said_at = time.monotonic()
        time.sleep(poll_s)


def _short(error: str) -> str:
    """A recorded error as a few words: its [CODE] when it has one (the code's docs say the rest)."""
    return error.split("]", 1)[0] + "]" if error.startswith("[") else error[:50]


def follow_started(manifest: dict[str, Any]) -> bool:
    """A partial hidden dataset begun by --follow: its shard count is unknown (0) until synth is complete."""
    return manifest.get("status") != "complete" and (manifest.get("params") or {}).get("num_shards") == 0


def resume_terms(ds: Dataset, sds: Dataset, *, follow: bool, num_shards: int
                 ) -> tuple[list[dict[str, str]], dict[str, Any] | None]:
    """The inputs and the params (open_output's `inputs`, `made_with`) to resume `ds` against.

    The synth manifest changes while synth runs, so a dataset begun by --follow, or resumed by it, is checked
    against its recorded input by name only (its shards are checked against the plan instead: check_shards),
    and the shard count, known only at the end, is not compared. Otherwise: the strict terms of every stage.
    """
    current = [input_ref(sds)]
    stored = ds.read_manifest() if ds.exists() else {}
    if not stored or not (follow or follow_started(stored)):
        return current, None
    inputs = stored.get("inputs") or []
    same_input = [i.get("ref") for i in inputs] == [sds.ref]
    partial = stored.get("status") != "complete"
    return (inputs if same_input and partial else current), {**(stored.get("params") or {}), "num_shards": num_shards}


def check_shards(ds: Dataset, sref: str, plan: list[list[SampleLine]]) -> list[int]:
    """The shards already in `ds` (a resumed run's), each checked to hold the samples the plan puts there; a
    shard the plan does not hold (its synth dataset was remade under the same name) is refused."""
    fix = f"delete it (`eyas-data rm {ds.ref}`) or pick another --name"
    made = made_shards(ds)  # consumed ones too: a training run used them and deleted them since
    there = [j for j in range(len(plan)) if shard_name(j) in made]
    extra = sorted(made - {shard_name(j) for j in there})
    if extra:
        raise DatasetError(f"{ds.ref}: {extra[0]} is there but {sref} now makes {len(plan)} final shards (it was "
                           f"remade since); {fix}")
    for j in (j for j in there if (ds.path / shard_name(j)).exists()):
        ids = open_shard(ds, ds.path / shard_name(j)).get_tensor("sample_ids").tolist()
        if ids != [r.id for r in plan[j]]:
            raise DatasetError(f"{ds.ref}: {shard_name(j)} holds samples {ids[:3]}... but {sref} now puts "
                               f"{[r.id for r in plan[j]][:3]}... there (it was remade since); {fix}")
    return there


def shard_entry(ds: Dataset, j: int, shard: list[SampleLine]) -> dict[str, Any]:
    """A final shard as the manifest lists it while partial: what a follower needs to take it, and the counts
    that finalizing needs once a training run has consumed it."""
    path, counts = ds.path / shard_name(j), count_shard(ds, j)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path), "records": len(shard),
            "tokens": counts.tokens, "masked_tokens": counts.masked_tokens, "first_id": shard[0].id,
            "last_id": shard[-1].id}


def list_shards(ds: Dataset, manifest: dict[str, Any], plan: list[list[SampleLine]], shards: list[int]) -> None:
    """Add final shards to the manifest's `files` (in shard order; an entry whose file matches is kept, not
    hashed again) and write it: shards made by a killed run, between rename and listing, are listed here."""
    listed = {e["name"]: e for e in manifest.get("files") or []}
    for j in (j for j in shards if (ds.path / shard_name(j)).exists()):
        path = ds.path / shard_name(j)
        old = listed.get(path.name)
        listed[path.name] = old if old and old.get("bytes") == path.stat().st_size else shard_entry(ds, j, plan[j])
    manifest["files"] = [listed[name] for name in sorted(listed) if (ds.path / name).exists()]
    update_manifest(ds, manifest)  # with the consumed entries, whose files are gone
