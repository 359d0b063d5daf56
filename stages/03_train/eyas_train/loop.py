"""The optimiser loop every draft method runs: steps, progress lines and the training log, validation on its
schedule (keeping the best draft, stopping early), and checkpoints."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas_common.contract import JsonlAppender, iter_jsonl
from eyas_common.drafts import BEST_FILE, CKPT_DIR, LOG_FILE, write_checkpoint
from eyas_train import parallel
from eyas_train.checkpoints import checkpoint
from eyas_train.data import prefetch
from eyas_train.hostmem import HeapTrimmer
from eyas_train.order import plan, shards_due
from eyas_train.state import RunState, say


def train_loop(s: RunState) -> None:
    """The optimiser loop: log, validate (and stop early) and checkpoint on their schedules."""
    cfg, d, total = s.cfg, s.d, s.recipe.total_steps
    window = torch.zeros(s.method.slots, 3, device=d.device)  # per step (DFlash: per slot): loss sum, hits, counted rows
    tokens, t_window = 0, time.monotonic()
    log = JsonlAppender(s.out.path / LOG_FILE, sync_every=1) if d.main else None
    heap = HeapTrimmer()
    # closed before an error propagates, so that the error's line is not appended to the bar's
    with tqdm(total=total, initial=s.start, disable=not d.main, desc="train", unit="step", dynamic_ncols=True) as bar:
        s.module.train()
        t_loop, stop = time.monotonic(), False
        for batch in prefetch(s.shards, plan(s), cfg.max_len, cfg.batching == "packed"):
            tokens += int(batch["length"].sum())
            loss, stats = s.method.forward(s, batch)
            # DDP/FSDP average gradients over ranks; the loss is already a global-batch mean, so undo the average.
            (loss * d.world).backward()
            gnorm = torch.nn.utils.clip_grad_norm_(s.trainable, cfg.grad_clip)
            s.opt.step()
            s.sched.step()
            s.opt.zero_grad(set_to_none=True)
            window += stats
            heap.after_step()
            bar.update(1)
            s.step += 1
            if s.step % cfg.log_every == 0 or s.step == total:
                s.last = _log_record(s, window, tokens, t_window, gnorm)
                _write_log(s, log, s.last, bar)
                window.zero_()
                tokens, t_window = 0, time.monotonic()
            stop = _maybe_validate(s, log, bar)
            if stop or s.step % cfg.ckpt_every == 0 or s.step == total or shards_due(s):
                checkpoint(s, train_s=s.train_s + time.monotonic() - t_loop)
            if stop:
                break
        if not stop and s.step < total:  # shard order, one pass: the data ran out before the recipe's steps
            s.recipe = dataclasses.replace(s.recipe, total_steps=s.step)
            _maybe_validate(s, log, bar)
            checkpoint(s, train_s=s.train_s + time.monotonic() - t_loop)
    s.train_s += time.monotonic() - t_loop
    if log is not None:
        log.close()
    if d.main and (line := heap.summary()):
        say(line)


def _write_log(s: RunState, log: JsonlAppender | None, record: dict[str, Any], bar: tqdm) -> None:
    if s.d.main:
        log.write(record)
        short = _short(record) if "loss" in record else _short_val(record)
        bar.set_postfix_str(short)
        say(f"step {record['step']}/{s.recipe.total_steps} " + short
            + (f" {record['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in record else ""))


def _maybe_validate(s: RunState, log: JsonlAppender | None, bar: tqdm) -> bool:
    """Validate on schedule (and at the last step); keep the best draft; True when training should stop."""
    every = s.recipe.eval_every
    if not every or (s.step % every and s.step != s.recipe.total_steps):
        return False
    record = s.method.validate(s)
    _write_log(s, log, record, bar)
    b = s.best
    if b["score"] is None or record["val_predicted"][-1] > b["score"] + 1e-3:
        b.update(step=s.step, score=record["val_predicted"][-1], stale=0, val=record)
        model_sd, _ = parallel.state_dicts(s.module, s.opt)
        if s.d.main:
            write_checkpoint(s.out.path / CKPT_DIR / BEST_FILE, {"step": s.step, "model": model_sd, "val": record})
    else:
        b["stale"] += 1
    if s.cfg.patience and b["stale"] >= s.cfg.patience and s.step < s.recipe.total_steps:
        if s.d.main:
            say(f"stopping early at step {s.step}: no better validation in {b['stale']} evaluations "
                f"(best at step {b['step']}; --patience {s.cfg.patience})")
        return True
    return False


def _log_record(s: RunState, window: torch.Tensor, tokens: int, t0: float, gnorm: torch.Tensor) -> dict[str, Any]:
    """The interval's record, summed over ranks: per-step mean loss and top-1 accuracy, and their
    weighted total (the training objective's value)."""
    d, step, decay = s.d, s.step, s.method.decay
    w = parallel.all_sum(window.clone(), d).cpu()
    n_tok = int(parallel.all_sum(torch.tensor([tokens], device=d.device), d).item())
    counted = w[:, 2].clamp(min=1)
    step_loss, step_acc = (w[:, 0] / counted).tolist(), (w[:, 1] / counted).tolist()
    return {
        "step": step, "epoch": round(step / s.recipe.steps_per_epoch, 3), "total_steps": s.recipe.total_steps,
        "lr": s.sched.get_last_lr()[0],
        "loss": sum(decay**k * v for k, v in enumerate(step_loss)),
        "step_loss": [round(v, 5) for v in step_loss],
        "step_acc": [round(v, 5) for v in step_acc],
        "grad_norm": float(gnorm),
        "tokens_per_s": n_tok / max(1e-9, time.monotonic() - t0),
    }


def _short(r: dict[str, Any]) -> str:
    return f"loss {r['loss']:.3f} acc " + "/".join(f"{a:.2f}" for a in r["step_acc"])


def _short_val(r: dict[str, Any]) -> str:
    return (f"validation loss {r['val_loss']:.3f} acc " + "/".join(f"{a:.2f}" for a in r["val_step_acc"])
            + f" predicted acceptance {r['val_predicted'][-1]:.2f} at {len(r['val_predicted'])} draft tokens")


def last_record(log: Path) -> dict[str, Any] | None:
    last = None
    for _, r in iter_jsonl(log):
        last = r if "loss" in r else last
    return last
