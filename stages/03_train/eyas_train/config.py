"""The training configuration: one flat record, saved in every checkpoint and in the draft's manifest."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TrainConfig:
    hidden: str                     # input hidden dataset, hidden/NAME
    model: str                      # target folder: tokenizer, config, embedding and lm_head are read from it
    name: str                       # output dataset, drafts/NAME
    draft_vocab: int = 32000        # draft vocabulary: most frequent loss-masked tokens (capped at the target's)
    ttt_steps: int = 7              # unrolled draft steps per sample (training-time test)
    step_decay: float = 0.8         # loss weight of step k is step_decay**k
    epochs: int = 10                # passes over the hidden dataset
    batch_size: int = 16            # samples per optimiser step, over all processes
    max_len: int = 2048             # rows kept per sample (longer samples are cut at the end)
    lr: float = 1e-4                # AdamW peak learning rate (the fixture recipe uses 3e-3 with batch 4)
    warmup: float = 0.03            # share of the steps with a linear warm-up, then cosine decay to 0
    weight_decay: float = 0.0
    grad_clip: float = 0.5          # max global gradient norm
    norm_before_residual: bool = False  # False: residual = fused hidden (EAGLE-3, SGLang); written to config.json
    seed: int = 0                   # init, and the data order of every epoch
    parallel: str = "ddp"           # under torchrun: ddp or fsdp (FSDP2); ignored in one process
    precision: str = "auto"         # auto: bf16 autocast on GPU, fp32 on CPU; or fp32 / bf16
    ckpt_every: int = 200           # optimiser steps between checkpoints (and one at the end)
    keep_ckpts: int = 2             # newest checkpoints kept
    log_every: int = 10             # optimiser steps between progress lines and log records
    trust_remote_code: bool = False  # the target's tokenizer code was run (explicit opt-in)
    init_draft: str | None = None   # start from this draft (eyas, vLLM/speculators or SpecForge layout)
    init_vocab: str = "keep"        # with init_draft: keep its draft vocabulary, or remap to this data's

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # What may change between a run and its resumption without changing the result.
    RESUMABLE_CHANGES = ("ckpt_every", "keep_ckpts", "log_every")

    def differences(self, other: dict[str, Any]) -> list[str]:
        mine = self.to_dict()
        return [f"{f.name}: {other.get(f.name)!r} -> {mine[f.name]!r}" for f in fields(self)
                if f.name not in self.RESUMABLE_CHANGES and other.get(f.name) != mine[f.name]]
