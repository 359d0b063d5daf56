"""A training run's state, shared by every draft method: what it trains on, the model and optimiser, and where
it stands; the optimiser and schedule it starts from, how a checkpoint is loaded into it, and its progress lines."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from eyas_common.contract import Dataset
from eyas_common.hidden import HiddenShards
from eyas_train import parallel
from eyas_train.config import TrainConfig
from eyas_train.methods.base import TrainMethod
from eyas_train.model import DraftConfig
from eyas_train.recipe import Recipe, lr_lambda
from eyas_train.stream import Consumption
from eyas_train.vocab import VocabMap


def say(msg: str) -> None:
    """A progress line on stderr that does not break the progress bar."""
    tqdm.write(f"[eyas-train] {msg}", file=sys.stderr)


def quiet(_: str) -> None:
    pass


@dataclass
class RunState:
    """One training run from set-up to export: its inputs, the resolved recipe, the model and optimiser,
    and where it stands (step, training time, best validation so far)."""
    cfg: TrainConfig
    d: parallel.Dist
    out: Dataset
    shards: HiddenShards
    recipe: Recipe
    train_idx: list[int]
    val_idx: list[int]
    lengths: list[int]            # kept rows per sample, all samples (--follow: all taken so far)
    vocab: VocabMap
    dcfg: DraftConfig
    aux_layers: list[int]
    target: dict[str, Any]
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    method: TrainMethod           # the draft method's hooks and own state (eyas_train.methods)
    start: int = 0                # the step this session starts at
    step: int = 0                 # optimiser steps done
    train_s: float = 0.0          # loop time summed over all sessions of the run
    best: dict[str, Any] = field(default_factory=lambda: {"step": None, "score": None, "stale": 0, "val": None})
    last: dict[str, Any] | None = None  # the newest training log record
    consumption: Consumption | None = None  # --consume: the shards used for the last time (stream.py)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]


def optimiser(cfg: TrainConfig, module: torch.nn.Module, recipe: Recipe) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable parameters, and its warm-up + cosine schedule."""
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=recipe.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe.total_steps, recipe.warmup_steps))


def resumed(s: RunState, ckpt: dict[str, Any] | None) -> RunState:
    """`s` with a checkpoint's model, optimiser, schedule, RNG and progress loaded (as it is without one)."""
    if ckpt is not None:
        parallel.load_state_dicts(s.module, s.opt, ckpt["model"], ckpt["optim"])
        s.sched.load_state_dict(ckpt["sched"])
        set_rng_state(ckpt["rng"])
        s.start = s.step = ckpt["step"]
        s.train_s, s.best = ckpt["train_s"], ckpt.get("best", s.best)
    return s


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
