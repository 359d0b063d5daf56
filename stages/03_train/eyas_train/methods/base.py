"""The interface every draft method implements, and what a method declares it cannot do.

train.py runs one loop for every method: it reads the hidden dataset, splits it, resolves the recipe, then asks
the method for its draft (`build`), a step's loss (`forward`), a validation record (`validate`) and the export
(`export`). eval.py loads an exported draft (`load`) and asks it for proposals (`propose`). A method is one
class in its own module, named in `eyas_train.methods.REGISTRY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol

import torch

from eyas_common.contract import Dataset
from eyas_common.hidden import HiddenShards
from eyas_train import parallel
from eyas_train.config import TrainConfig
from eyas_train.recipe import predicted_acceptance
from eyas_train.vocab import VocabMap


@dataclass
class Inputs:
    """What every method's draft is built from: the run's config and processes, the hidden dataset and what the
    shared set-up read from it, and the checkpoint it resumes from (None: a fresh run)."""
    cfg: TrainConfig
    d: parallel.Dist
    hidden_ds: Dataset
    shards: HiddenShards
    vocab_shards: int | None      # the shards the draft vocabulary is counted over (None: all)
    target: dict[str, Any]        # the target's text config
    hidden_size: int
    aux_layers: list[int]
    out: Dataset
    ckpt: dict[str, Any] | None
    data_root: Path | None
    say: Callable[[str], None]


@dataclass
class Built:
    """A method's draft, ready to train: the module the loop steps (its loss inside), the draft vocabulary,
    the shape the export writes, and the method's own state (a method instance)."""
    module: torch.nn.Module
    vocab: VocabMap
    dcfg: Any
    method: "TrainMethod"


class TrainMethod(Protocol):
    name: ClassVar[str]
    streams: ClassVar[bool]                 # trains in shard order (--order shards, --follow)
    own_options: ClassVar[tuple[str, ...]]  # TrainConfig fields only this method reads
    slots: int                              # rows of a step's stats: TTT steps (EAGLE-3) or block slots (DFlash)
    decay: float                            # loss weight of row k is decay**k

    @classmethod
    def build(cls, x: Inputs) -> Built: ...

    def forward(self, s: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of this rank's share of a global batch, and its per-row stats [slots, 3]."""

    def validate(self, s: Any) -> dict[str, Any]:
        """val_loss, val_step_acc, val_predicted (replayed acceptance for 1..slots tokens), val_chain_product."""

    def export(self, s: Any, state: dict[str, torch.Tensor]) -> None: ...

    @staticmethod
    def reexport(folder: Path, state: dict[str, torch.Tensor], params: dict[str, Any],
                 target: dict[str, Any]) -> None:
        """`eyas-train export` of a checkpoint, the shape from the draft manifest's params."""

    @staticmethod
    def load(folder: Path, model: str | Path) -> tuple[torch.nn.Module, list[int]]:
        """An exported draft as a module (fp32) and the aux ids it reads."""

    @staticmethod
    def propose(draft: Any, ids: torch.Tensor, aux: torch.Tensor, k: int) -> list[int]:
        """The k tokens the draft proposes after `ids`, given the target's aux states of ids[:-1]."""

    @staticmethod
    def reported_k(n_predicted: int) -> int:
        """The speculative-token count the run's last line reports the predicted acceptance at."""


def validation_record(step: int, window: torch.Tensor, replay: torch.Tensor, decay: float) -> dict[str, Any]:
    """The validation log record from summed per-row stats [rows, 3] (loss sum, hits, counted) and the replay's
    [rows, 2] (drafts, accepted tokens) for 1..rows draft tokens. Every method writes this record."""
    counted = window[:, 2].clamp(min=1)
    acc = (window[:, 1] / counted).tolist()
    return {"step": step,
            "val_loss": round(sum(decay**k * v for k, v in enumerate((window[:, 0] / counted).tolist())), 5),
            "val_step_acc": [round(a, 5) for a in acc],
            "val_predicted": [round(1 + float(a / max(1.0, float(n))), 4) for n, a in replay.tolist()],
            "val_chain_product": [round(predicted_acceptance(acc, k), 4) for k in range(1, len(acc) + 1)]}
