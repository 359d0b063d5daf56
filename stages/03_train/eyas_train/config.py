"""The training configuration: one flat record, saved in every checkpoint and in the draft's manifest."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

# What may change between a run and its resumption without changing the result; every other field must
# match (eyas_common.contract.open_output). `batching` lays out the same samples with the same loss
# (ttt.py), so it changes only the speed.
MAY_CHANGE = ("ckpt_every", "keep_ckpts", "log_every", "patience", "trust_remote_code", "batching", "follow",
              "poll_seconds", "consume")

# Every TTT step keeps its activations for the backward pass: far past the 3-8 tokens drafts are served at, a step
# count only runs out of memory (500 steps of two 141-token samples took 18 GB of host memory and were killed).
MAX_TTT_STEPS = 32

# The sampled head (ttt.py) always scores each row's TEACHER_TOP likeliest teacher tokens.
TEACHER_TOP = 8


@dataclass(frozen=True)
class TrainConfig:
    hidden: str                     # input hidden dataset, hidden/NAME
    model: str                      # target folder: tokenizer, config, embedding and lm_head are read from it
    name: str                       # output dataset, drafts/NAME
    draft_vocab: int = 32000        # draft vocabulary: most frequent loss-masked tokens (capped at the target's)
    ttt_steps: int = 4              # unrolled draft steps per sample (training-time test): served K 3, plus one
    step_decay: float = 0.8         # loss weight of step k is step_decay**k
    head_negatives: int | None = None  # sampled head: columns drawn per chunk besides the teacher's top (ttt.py);
                                    # 0: exact; None: recipe.head_negatives (sampled on large draft vocabularies)
    # None below: resolved from the data by recipe.py (the rule and its evidence: stages/03_train/README.md);
    # the resolved values are in the draft's manifest (params.recipe).
    epochs: float | None = None     # passes over the training samples; 0 exports the untrained draft
    batch_size: int | None = None   # samples per optimiser step, over all processes
    max_len: int = 2048             # rows kept per sample (longer samples are cut at the end)
    batching: str = "packed"        # packed: a step's samples end to end in rows, attention kept within each;
                                    # padded: one right-padded sample per row (same samples and loss, slower)
    lr: float | None = None         # AdamW peak learning rate
    warmup_steps: int | None = None  # optimiser steps of linear warm-up, then cosine decay to 0
    batch_tokens: int = 16384       # rule: tokens per optimiser step once the data is large enough
    min_steps: int = 2000           # rule: floor on optimiser steps (small data), as far as max_epochs allows
    max_epochs: int = 20            # rule: most passes over small data
    token_budget: int = 1_000_000_000  # rule: tokens trained on when the data is large (>= one pass)
    val_samples: int | None = None  # held out of the hidden dataset by sample id; 0: no validation
    eval_every: int | None = None   # optimiser steps between validations (default: 20 over the run)
    patience: int = 5               # stop after this many validations without a better one; 0: never stop early
    weight_decay: float = 0.0
    grad_clip: float = 0.5          # max global gradient norm
    norm_before_residual: bool = False  # False: residual = fused hidden (EAGLE-3, SGLang); written to config.json
    seed: int = 0                   # init, and the data order of every epoch
    order: str = "random"           # random: every epoch a seeded permutation of the whole dataset; shards: the
                                    # first pass walks the shards in order, a window at a time (stream.py)
    window_shards: int = 4          # --order shards: shards whose samples are shuffled together
    follow: bool = False            # --order shards on a hidden dataset eyas-extract --follow still writes
    poll_seconds: float = 5.0       # --follow: seconds between looks at the hidden manifest
    consume: bool = False           # --order shards: delete each shard after its last use (stream.Consumption)
    parallel: str = "ddp"           # under torchrun: ddp or fsdp (FSDP2); ignored in one process
    precision: str = "auto"         # auto: bf16 autocast on GPU and on CPUs with native bf16, else fp32; or fp32 / bf16
    ckpt_every: int = 200           # optimiser steps between checkpoints (and one at the end)
    keep_ckpts: int = 2             # newest checkpoints kept
    log_every: int = 10             # optimiser steps between progress lines and log records
    trust_remote_code: bool = False  # the target's tokenizer code was run (explicit opt-in)
    init_draft: str | None = None   # start from this draft (eyas, vLLM/speculators or SpecForge layout)
    init_vocab: str = "keep"        # with init_draft: keep its draft vocabulary, or remap to this data's
    # --method dflash (dflash.py); None: from the target (the resolved values are in the manifest's params.draft)
    method: str = "eagle3"          # eagle3 or dflash
    block_size: int | None = None   # DFlash: anchor + block_size - 1 masked slots (vLLM: K = block_size - 1)
    draft_layers: int | None = None  # DFlash: decoder layers of the draft
    anchors: int = 512              # DFlash: most anchors drawn per sample and step
    gamma: float | None = None      # DFlash: slot j's loss weight is exp(-(j - 1) / gamma)
    mask_token_id: int | None = None  # DFlash: the token filling masked slots (default: one absent from the data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def as_saved(cls, saved: dict[str, Any]) -> dict[str, Any]:
        """A config an earlier run saved (in a checkpoint), with the default of each field added since: what
        that run used."""
        return cls.defaults() | saved


@dataclass(frozen=True)
class EvalOptions:
    """What `eyas-train eval` is asked: the draft's acceptance offline, the target in transformers."""

    draft: str                      # drafts/NAME
    model: str                      # target folder
    prompts: str                    # held-out prompts file
    spec_tokens: int | None = None  # draft tokens per step; None: the draft's own (EAGLE-3 3, DFlash block - 1)
    max_tokens: int = 256           # completion budget per prompt, tokens
    thinking: bool | None = None    # the template's thinking switch; None: decided from the target
    limit: int | None = None        # first prompts only; None: all
    dtype: str = "auto"             # auto: bf16 on GPU, fp32 on CPU (the serving dtype, for agreement)
    device_map: str | None = None   # transformers device_map; None: auto on GPU
    trust_remote_code: bool = False
    out: str | None = None          # also write the result as JSON here
