"""The stage's configurations: what `launch` starts and what `bench` measures (saved in bench/NAME)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class LaunchConfig:
    engine: str                      # vllm or sglang
    model: str                       # target folder (local path): the tokenizer the draft is checked against
    draft: str | None = None         # drafts/NAME; None serves the target alone (the baseline)
    spec_tokens: int | None = None   # draft tokens proposed per verification (vLLM num_speculative_tokens,
                                     # SGLang num_steps; SGLang verifies spec_tokens + 1 tokens); None = the
                                     # draft's own: EAGLE-3 3, DFlash its block size - 1 (the block it learned)
    prompt_lookup: bool = False      # vLLM's n-gram prompt lookup instead of a draft (nothing trained): the
                                     # reference a draft has to beat, at spec_tokens (None = 3)
    tp: int = 1                      # tensor-parallel GPUs
    host: str = "127.0.0.1"
    port: int = 8000
    health_timeout_s: float = 900.0  # start-up budget: a large target loads for minutes
    log: str = ""                    # engine output goes here; "" = serve-ENGINE-PORT.log in the current folder
    python: str = ""                 # interpreter that has the engine; "" = EYAS_VLLM_PYTHON / .venv-vllm / this one
    nccl_p2p_disable: bool = False   # NCCL_P2P_DISABLE=1: multi-GPU Blackwell workstations hang in P2P all-reduce
    disable_custom_all_reduce: bool = False  # the engine's custom all-reduce kernel off (NCCL only), same hosts
    trust_remote_code: bool = False  # the target ships its own model/tokenizer code (Kimi-K2.5): explicit opt-in
    engine_args: tuple[str, ...] = ()  # passed to the engine last (after `--`), so they override eyas' flags

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BenchOptions:
    """What `eyas-serve bench` is asked; `bench.run` checks them and records a BenchConfig."""

    server: str                      # URL of target + draft
    prompts: Path                    # held-out prompts file
    name: str                        # output dataset bench/NAME
    baseline: str | None = None      # URL of the same target served alone; None: no speedup
    draft: str | None = None         # drafts/NAME the server runs (lineage)
    concurrency: tuple[int, ...] = (1, 4, 16)
    num_prompts: int = 0
    max_tokens: int = 256
    temperature: float = 0.0
    timeout_s: float = 600.0
    warmup: int = 2
    engine: str | None = None        # of both servers; None: detected


@dataclass(frozen=True)
class BenchConfig:
    name: str                        # output dataset bench/NAME
    server: str                      # URL of target + draft
    prompts: str                     # held-out prompts (JSONL messages / conversations, or text lines)
    prompts_sha256: str
    baseline: str | None = None      # URL of the same target without speculation: speedup is measured against it
    draft: str | None = None         # drafts/NAME the server runs: lineage (draft -> hidden -> synth -> target)
    concurrency: tuple[int, ...] = (1, 4, 16)  # requests in flight: each level measured in turn
    num_prompts: int = 0             # requests per level; 0 = every prompt once
    max_tokens: int = 256            # completion budget per request, tokens
    temperature: float = 0.0         # greedy by default: acceptance is then a property of the draft alone
    timeout_s: float = 600.0         # per request
    warmup: int = 2                  # requests sent to each server before measuring (not counted)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
