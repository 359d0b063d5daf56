"""The extraction config: one flat dataclass, saved as the hidden dataset's manifest `params`."""

from __future__ import annotations

from dataclasses import dataclass

# Params a resumed run (or another `--shard i/N` part) may change: where the target lies, how it is placed
# and how attention is computed. Every other param decides a shard's bytes and must match, including any
# added later.
MAY_CHANGE = ("model", "attn", "device_map", "trust_remote_code", "max_memory", "tensor_parallel_size",
              "enable_expert_parallel", "placement")
AUX_DTYPES = ("bf16", "fp8", "fp32")
TEACHERS = ("final", "topk")
BACKENDS = ("hf", "vllm")


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
