"""Real OpenAI-compatible servers for tests and benchmarks, on 127.0.0.1 in their own process group: vLLM
(the CPU build in its own venv, or any python that has vLLM) by the command line `eyas-serve launch` runs,
and eyas_testing.hf_server for targets vLLM cannot load here.

The process handling is the serve stage's (eyas_serve.process); this module adds a free port, the CPU
defaults and the `with` blocks the tests use, and re-exports the rest so that tests import one module.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from eyas_serve.config import LaunchConfig
from eyas_serve.engines import default_vllm_python, engine_command, engine_env, vllm_cpu_env
from eyas_serve.process import VllmServer, log_tail, start_server, stop, wait_healthy

__all__ = ["VllmServer", "default_vllm_python", "free_port", "log_tail", "running_hf_server", "running_vllm",
           "start_hf_server", "start_server", "start_vllm", "stop", "vllm_cpu_env", "wait_healthy"]

# vLLM's CPU build: fp32 is much faster there than bf16, and the fixtures' answers fit in 1024 tokens.
CPU_ARGS = ("--max-model-len", "1024", "--dtype", "float32")


def free_port() -> int:
    # Another process may take it before vLLM binds; good enough for a single test machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(
    model: Path,
    *,
    log_path: Path,
    port: int | None = None,
    draft: Path | None = None,
    spec_tokens: int = 3,
    prompt_lookup: bool = False,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    python: Path | None = None,
) -> VllmServer:
    """Launch vLLM on 127.0.0.1 in its own process group: the users' command (eyas_serve.engines), with the
    EAGLE-3 draft folder `draft` when given, or vLLM's prompt lookup (`prompt_lookup`).

    Defaults suit the CPU build: fp32, a 1024-token context (CPU_ARGS) and 1 GiB of KV cache. `extra_args`
    come last, so a repeated flag there overrides a default.
    """
    python = Path(python) if python else default_vllm_python()
    if not python.exists():
        raise FileNotFoundError(f"no vLLM interpreter at {python}: run `make vllm` (or set EYAS_VLLM_PYTHON)")
    cfg = LaunchConfig(engine="vllm", model=str(model), spec_tokens=spec_tokens, prompt_lookup=prompt_lookup,
                       port=port or free_port(), python=str(python), engine_args=(*CPU_ARGS, *extra_args))
    cmd = engine_command(cfg, Path(draft) if draft else None)
    return start_server(cmd, port=cfg.port, log_path=log_path, env={**engine_env(cfg), **(env or {})},
                        host=cfg.host)


@contextmanager
def _healthy(server: VllmServer, timeout_s: float) -> Iterator[VllmServer]:
    try:
        wait_healthy(server, timeout_s)
        yield server
    finally:
        stop(server)


def running_vllm(model: Path, *, log_path: Path, timeout_s: float = 300, **kwargs):
    """A healthy vLLM server for the duration of the `with` block (see `start_vllm` for kwargs)."""
    return _healthy(start_vllm(model, log_path=log_path, **kwargs), timeout_s)


def start_hf_server(model: Path, *, log_path: Path, port: int | None = None, trust_remote_code: bool = False,
                    python: Path | None = None) -> VllmServer:
    """Launch eyas_testing.hf_server (transformers generation, vLLM's response shape) on 127.0.0.1:
    for targets vLLM cannot load here, such as the Kimi-K2.5-shaped fixture. Stop it with `stop`."""
    port = port or free_port()
    cmd = [str(python or sys.executable), "-m", "eyas_testing.hf_server", "--model", str(model),
           "--port", str(port), *(["--trust-remote-code"] if trust_remote_code else [])]
    return start_server(cmd, port=port, log_path=log_path, env={"HF_HUB_OFFLINE": "1"})


def running_hf_server(model: Path, *, log_path: Path, timeout_s: float = 300, **kwargs):
    """A healthy eyas_testing.hf_server for the duration of the `with` block (see `start_hf_server`)."""
    return _healthy(start_hf_server(model, log_path=log_path, **kwargs), timeout_s)
