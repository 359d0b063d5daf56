"""Which samples each optimiser step trains on: the split of the hidden dataset into training and validation
samples, the plan of every step (seeded epochs in random order; shard order streams the first pass, stream.py),
and, with --consume, the shards past their last use and the refusals of a wait that could never end."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from eyas_common.contract import DatasetError
from eyas_common.hidden import HiddenShards, consume, shard_name, size_text
from eyas_train import parallel
from eyas_train.config import TrainConfig
from eyas_train.data import global_batches, rank_share
from eyas_train.recipe import Recipe, resolve, split_by_sample, val_count
from eyas_train.state import RunState, quiet, say
from eyas_train.stream import (deadlock_error, expected_samples, extract_blocked, first_window, largest_shard,
                               stream_batches, wait_for_shards)


def split(cfg: TrainConfig, d: parallel.Dist, shards: HiddenShards, hidden_m: dict[str, Any], hidden_size: int,
           ckpt: dict[str, Any] | None) -> tuple[list[int], list[int], Recipe, int | None]:
    """(training indices, validation indices, recipe, shards the vocabulary is counted over: None for all).
    Random order: from the whole dataset. Shard order: from the first window alone (stream.py), the
    training indices those of the first window (the plan takes the rest as they come)."""
    if cfg.order == "random":
        lengths = [min(x.length, cfg.max_len) for x in shards.samples]
        n_val = val_count(len(shards), cfg.val_samples, d.world)
        train_idx, val_idx = split_by_sample([x.sample_id for x in shards.samples], n_val, cfg.seed)
        return train_idx, val_idx, resolve(cfg, lengths=[lengths[i] for i in train_idx], n_val=n_val,
                                           width=hidden_size, world=d.world), None
    expected = (ckpt or {}).get("expected_samples") or expected_samples(shards.ds, hidden_m)
    n_val = val_count(expected, cfg.val_samples, d.world)
    n_shards = wait_for_shards(shards, cfg.window_shards, poll_s=cfg.poll_seconds, say=say if d.main else quiet,
                               stuck=(lambda _: refuse_first_window_deadlock(shards, cfg)) if cfg.consume else None)
    window = first_window(shards, n_shards, n_val)
    if ckpt and "val_ids" in ckpt:  # a resumed run: the window's shards may be consumed (counted, not read)
        val_ids = set(ckpt["val_ids"])
        val_idx = [i for i in window if shards.samples[i].sample_id in val_ids]
        return [i for i in window if i not in set(val_idx)], val_idx, Recipe(**ckpt["recipe"]), n_shards
    local, val_local = split_by_sample([shards.samples[i].sample_id for i in window], n_val, cfg.seed)
    train_idx, val_idx = [window[i] for i in local], [window[i] for i in val_local]
    recipe = resolve(cfg, lengths=[min(shards.samples[i].length, cfg.max_len) for i in train_idx], n_val=n_val,
                     width=hidden_size, world=d.world, n=expected - n_val)
    return train_idx, val_idx, recipe, n_shards


def plan(s: RunState) -> Iterator[list[int] | None]:
    """This rank's samples for every remaining step (None: a wait for shards follows, see stream.py)."""
    if s.cfg.order == "random":
        r = s.recipe
        for step in range(s.start, r.total_steps):
            epoch, b = divmod(step, r.steps_per_epoch)
            batch = global_batches(r.train_samples, r.batch_size, s.cfg.seed, epoch)[b]
            yield rank_share([s.train_idx[i] for i in batch], s.lengths, s.d.rank, s.d.world)
        return
    step = 0
    for batch in _shard_order(s):
        if batch is None:  # a wait for shards follows
            yield None
            continue
        if step >= s.start:
            s.lengths += [min(x.length, s.cfg.max_len) for x in s.shards.samples[len(s.lengths):]]
            yield rank_share(batch, s.lengths, s.d.rank, s.d.world)
        step += 1


def _shard_order(s: RunState) -> Iterator[list[int] | None]:
    """Every step's global batch in shard order: the streamed first pass (stream.py), then seeded epochs
    over the whole dataset until the recipe's steps are done."""
    r, cfg, val = s.recipe, s.cfg, set(s.val_idx)

    def wait(upto: int) -> int:
        return wait_for_shards(s.shards, upto, poll_s=cfg.poll_seconds, say=say if s.d.main else quiet,
                               stuck=lambda upto: refuse_budget_deadlock(s, upto))

    step = 0
    for item in stream_batches(s.shards, window=cfg.window_shards, val=val, batch_size=r.batch_size,
                               seed=cfg.seed, wait=wait):
        if item is None:
            yield None
            continue
        batch, taken, carried = item
        if s.consumption:
            s.consumption.dealt_batch(step, batch, taken, carried)
        yield batch
        step += 1
        if step == r.total_steps:
            return
    if s.consumption:
        s.consumption.all_dealt()
    if r.total_steps <= r.steps_per_epoch:  # a one-pass recipe: the run ends with the data
        return
    s.train_idx = [i for i in range(len(s.shards)) if i not in val]
    for epoch in itertools.count(1):
        batches = global_batches(len(s.train_idx), r.batch_size, cfg.seed, epoch)
        if not batches:
            raise DatasetError(f"{s.shards.ds.ref}: {len(s.train_idx)} training samples are fewer than one batch "
                               f"of {r.batch_size}: lower --batch-size (or --val-samples)")
        for batch in batches:
            yield [s.train_idx[i] for i in batch]
            step += 1
            if step == r.total_steps:
                return


def consuming_now(s: RunState) -> bool:
    """--consume with a one-pass recipe: shards go as the run passes them (otherwise all at the end)."""
    return s.consumption is not None and s.recipe.total_steps <= s.recipe.steps_per_epoch


def shards_due(s: RunState) -> bool:
    """Shards are past their last use now. They are freed at once (a checkpoint, then the deletion), not at the
    next --ckpt-every: extract may be waiting under its --disk-budget for exactly these, and this run for
    extract's next shards. The same on every rank: it follows the plan, not the clock."""
    return consuming_now(s) and bool(s.consumption.due(s.step))


def consume_shards(s: RunState, shards: list[int]) -> None:
    """Delete shards used for the last time (their last step is in a checkpoint), marked in the hidden manifest."""
    if shards:
        names = [shard_name(j) for j in shards]
        consume(s.shards.ds, names, by=s.out.ref, step=s.step)
        run = shards[-1] - shards[0] == len(shards) - 1  # a contiguous run of shards, or one
        which = f"{names[0]} .. {names[-1]}" if run and len(names) > 1 else ", ".join(names[:3]) + \
            (f" and {len(names) - 3} more" if len(names) > 3 else "")
        say(f"consumed {len(shards)} shard(s) of {s.shards.ds.ref} (--consume): {which}")


def refuse_budget_deadlock(s: RunState, upto: int) -> None:
    """Stop when extract waits for room under its --disk-budget that only this run could free, while this run
    waits for shard upto-1. Waiting here, the run frees nothing before that shard comes: what was past its
    last use went at once (shards_due), the validation shards go at the end, and so does everything when
    the recipe takes more than one pass. Only this run deletes shards, so the two would wait for ever."""
    blocked = extract_blocked(s.shards, upto) if s.consumption else None
    if blocked is None:
        return
    if consuming_now(s):
        # At most on disk at once: the validation shards, the shards of the < B samples a batch carries into
        # the next window, and that window's W shards (the last of them being written).
        keep, carry, w = len(s.consumption.keep), s.recipe.batch_size - 1, s.cfg.window_shards
        largest, most = largest_shard(s.shards, blocked[0]), keep + carry + w
        fix = f"rerun extract with --disk-budget {size_text(most * largest)} or more, or lower --window-shards"
    else:
        fix = "give extract a --disk-budget that holds the whole dataset, or train one pass (--epochs 1)"
    raise deadlock_error(s.shards, *blocked, fix=fix)


def refuse_first_window_deadlock(shards: HiddenShards, cfg: TrainConfig) -> None:
    """The same before the first window is there: nothing is trained, so nothing can be freed, until it is."""
    blocked = extract_blocked(shards, cfg.window_shards)
    if blocked is not None:
        w, largest = cfg.window_shards, largest_shard(shards, blocked[0])
        raise deadlock_error(shards, *blocked, fix=f"rerun extract with --disk-budget well above "
                             f"{size_text(w * largest)}, or lower --window-shards")
