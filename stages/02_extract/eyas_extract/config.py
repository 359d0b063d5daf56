"""Stage 02's two records: the options a run is asked with (`ExtractOptions`, built by the CLI), and the
extraction config they resolve to (`ExtractConfig`: dims read from the target, dtypes and attention picked
for the device, the shard plan), saved as the hidden dataset's manifest `params`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Params a resumed run (or another `--shard i/N` part) may change: where the target lies, how it is placed
# and how attention is computed. Every other param decides a shard's bytes and must match, including any
# added later.
MAY_CHANGE = ("model", "attn", "device_map", "trust_remote_code", "max_memory", "tensor_parallel_size",
              "enable_expert_parallel", "placement")
AUX_DTYPES = ("bf16", "fp8", "fp32")
TEACHERS = ("final", "topk")
BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class ExtractOptions:
    """What `eyas-extract run` is asked (its options, defaults as in --help); `run` resolves them."""

    synth: str                    # input synth dataset, synth/NAME (complete, or being written with follow)
    model: Path                   # local path of the target the synth dataset was made with
    name: str                     # output dataset: hidden/NAME (resumed if present)
    backend: str = "hf"           # hf: transformers + forward hooks; vllm: vLLM's extract_hidden_states
    method: str = "eagle3"        # the draft method the layers are for (eyas_common.methods): eagle3 | dflash
    layers: list[int] | None = None  # aux layer ids; None: the method's (eagle3 [2, L//2, L-3], dflash five)
    teacher: str = "final"        # final: the final normed hidden state; topk: the target's top-K log-probs
    topk: int = 8                 # K for teacher topk
    aux_dtype: str = "bf16"       # stored aux dtype: bf16 | fp8 | fp32
    shard: str = "0/1"            # I/N: this host makes shards j with j mod N == I (torchrun ranks split further)
    shard_samples: int = 2048     # at most this many samples per shard
    shard_mb: int = 2048          # at most this many MiB per shard (sets the shard's token budget)
    batch_tokens: int = 16384     # padded tokens per forward (batch size x longest sample)
    dtype: str = "auto"           # compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    device: str = "auto"          # hf backend: cpu, cuda, cuda:1, ...; auto: cuda if present (LOCAL_RANK's)
    attn: str = "auto"            # hf backend attention; auto: flash_attention_2 when installed on GPU, else sdpa
    device_map: str | None = None  # hf backend: transformers device_map for a target larger than one GPU
    trust_remote_code: bool = False  # run modelling/tokenizer code shipped with the target (explicit opt-in)
    allow_code_change: bool = False  # resume a dataset started by another eyas version
    max_memory: dict[str, str] | None = None  # with a device_map: budget per device; None: the planner's
    devices: str | None = None    # plan for this machine instead of the detected one (dry runs only)
    dry_run: bool = False         # print the placement plan, the disk bill and the estimated time, then stop
    follow: bool = False          # take a synth dataset still being written, each shard once final (follow.py)
    poll_seconds: float = 5.0     # with follow: how often synth's files are read again
    disk_budget: int | None = None  # with follow: most bytes of shards not yet consumed by training (eyas-train
                                    # --consume); None: no limit
    consumer_grace: float = 600.0  # with disk_budget: seconds with no training run consuming before extract stops


@dataclass
class ExtractConfig:
    synth: str                    # input dataset ref, synth/NAME
    model: str                    # local path of the target (weights, config, tokenizer)
    backend: str                  # hf: transformers forward + hooks; vllm: vLLM's extract_hidden_states
    layers: list[int]             # aux layer ids k: HF hidden_states[k], the residual stream entering layer k
    num_layers: int               # L, decoder layers of the target
    hidden_size: int              # H
    vocab_size: int               # V, rows of the target's lm_head
    aux_dtype: str                # bf16 | fp8 (float8_e4m3fn + a float32 scale per token and layer) | fp32
    teacher: str                  # final: the normed last hidden state; topk: the target's top-K log-probs
    topk: int                     # K for teacher topk (0 with teacher final)
    shard_samples: int            # at most this many samples per shard
    shard_tokens: int             # at most this many tokens per shard (from --shard-mb and the bytes per token)
    num_shards: int               # shards in the plan (derived from the synth dataset and the two above)
    batch_tokens: int             # padded tokens per forward (batch size x longest sample in it)
    dtype: str                    # compute dtype of the target: bfloat16 (GPU) or float32 (CPU)
    attn: str                     # attention implementation (hf backend): flash_attention_2 | sdpa | eager
    device_map: str | None        # transformers device_map for targets larger than one GPU (hf backend)
    trust_remote_code: bool       # explicit opt-in for targets that ship their own modelling code
    max_memory: dict[str, str] | None = None  # device_map budget per device (placement.py), e.g. {"0": "86000MiB"}
    tensor_parallel_size: int = 1     # vllm backend: GPUs per copy of the target (placement.py)
    enable_expert_parallel: bool = False  # vllm backend: routed experts split over those GPUs (MoE targets)
    placement: str = ""           # the placement plan as printed (placement.py)

    @property
    def stored_dtype(self) -> str:
        """dtype of `final` (and of `aux` unless fp8): fp32 only when asked for."""
        return "fp32" if self.aux_dtype == "fp32" else "bf16"
