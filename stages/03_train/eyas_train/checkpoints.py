"""A run's checkpoints: drafts/NAME/checkpoints/step-N (the format's owner is eyas_common.drafts), written on the
loop's schedule with everything a resume needs, the newest few kept; and the checkpoint a rerun resumes from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas_common.contract import Dataset, DatasetError
from eyas_common.drafts import CKPT_DIR, checkpoint_name, checkpoint_paths, read_checkpoint, readable_checkpoint, \
    write_checkpoint
from eyas_train import parallel
from eyas_train.order import consume_shards, consuming_now
from eyas_train.state import RunState, rng_state


def checkpoints(folder: Path) -> list[Path]:
    return checkpoint_paths(folder)


def save_checkpoint(folder: Path, payload: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint (atomically: eyas_common.drafts), then drop all but the newest `keep`."""
    path = write_checkpoint(folder / CKPT_DIR / checkpoint_name(payload["step"]), payload)
    for old in checkpoints(folder)[:-keep]:
        old.unlink()
    return path


def resume_checkpoint(out: Dataset) -> dict[str, Any] | None:
    """The newest checkpoint of a partial draft (None: none yet, or the draft is complete). An unreadable one
    is refused, naming the checkpoint the rerun would resume from once it is deleted."""
    found = checkpoints(out.path) if out.exists() and out.read_manifest().get("status") != "complete" else []
    if not found:
        return None
    try:
        return read_checkpoint(found[-1])
    except DatasetError as e:
        good = readable_checkpoint(found[:-1])
        fix = (f"delete it and rerun the same command to resume from {good.name}, the newest readable one" if good
               else f"no checkpoint in {found[-1].parent} is readable: delete that folder and rerun the same command "
                    f"to start over")
        raise DatasetError(f"{e.message}; {fix}") from None


def checkpoint(s: RunState, *, train_s: float) -> None:
    model_sd, opt_sd = parallel.state_dicts(s.module, s.opt)  # collective under FSDP: every rank takes part
    if s.d.main:
        v = s.vocab
        epoch, batch = divmod(s.step, s.recipe.steps_per_epoch)
        save_checkpoint(s.out.path, {
            "step": s.step, "epoch": epoch, "batch_in_epoch": batch, "train_s": train_s, "config": s.cfg.to_dict(),
            "model": model_sd, "optim": opt_sd, "sched": s.sched.state_dict(), "rng": rng_state(), "best": s.best,
            "vocab": {"d2t": v.d2t, "t2d": v.t2d, "coverage": v.coverage, "distinct": v.distinct},
            "expected_samples": s.recipe.train_samples + s.recipe.val_samples, "recipe": s.recipe.to_dict(),
            "val_ids": [s.shards.samples[i].sample_id for i in s.val_idx],
        }, s.cfg.keep_ckpts)
    if consuming_now(s):
        due = s.consumption.due(s.step)
        if s.d.main:
            consume_shards(s, due)
        s.consumption.done.update(due)  # on every rank: shards_due must agree
    parallel.barrier(s.d)
