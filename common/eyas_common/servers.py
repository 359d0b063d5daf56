"""Start and stop a real OpenAI-compatible server (vLLM: the CPU build in its own venv, or any python
that has vLLM; SGLang) in its own process group, for tests and the serve stage (`eyas-serve launch`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from eyas_common.paths import cache_root

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_vllm_python() -> Path:
    """The interpreter that has vLLM: `EYAS_VLLM_PYTHON`, else the repo's `.venv-vllm` (`make vllm`)."""
    return Path(os.environ.get("EYAS_VLLM_PYTHON", REPO_ROOT / ".venv-vllm" / "bin" / "python"))


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT, without /v1
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def free_port() -> int:
    # Another process may take it before vLLM binds; good enough for a single test machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


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


def start_server(cmd: Sequence[str], *, port: int, log_path: Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> VllmServer:
    """Run an OpenAI-compatible server command in its own process group, its output going to `log_path`."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
    return VllmServer(url=f"http://{host}:{port}", port=port, proc=proc, log_path=log_path)


def start_vllm(
    model: Path,
    *,
    log_path: Path,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    python: Path | None = None,
) -> VllmServer:
    """Launch `vllm.entrypoints.openai.api_server` on 127.0.0.1 in its own process group.

    Defaults suit the CPU build: fp32 (much faster than bf16 there), a 1024-token context and 1 GiB
    of KV cache. `extra_args` come last, so a repeated flag there overrides a default.
    """
    python = Path(python) if python else default_vllm_python()
    if not python.exists():
        raise FileNotFoundError(f"no vLLM interpreter at {python}: run `make vllm` (or set EYAS_VLLM_PYTHON)")
    port = port or free_port()
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", "1024",
        "--dtype", "float32",
        *extra_args,
    ]
    return start_server(cmd, port=port, log_path=log_path, env={**vllm_cpu_env(), **(env or {})})


def wait_healthy(server: VllmServer, timeout_s: float = 300) -> None:
    """Poll GET /health until 200; raise with the log's tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while True:
            code = server.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"the server exited with code {code} before becoming healthy; last lines of {server.log_path}:\n"
                    + log_tail(server.log_path)
                )
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the server was not healthy after {timeout_s:.0f}s; last lines of {server.log_path}:\n"
                    + log_tail(server.log_path)
                )
            time.sleep(1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop(server: VllmServer, timeout_s: float = 30) -> None:
    """SIGTERM the server's process group, SIGKILL whatever is left of it after `timeout_s`.

    The whole group, because vLLM forks an engine-core process that can outlive the API server.
    """
    pgid = server.proc.pid  # start_new_session made the server its group's leader
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.proc.poll()  # reap the leader, or it stays a zombie and keeps the group alive
        if not _group_alive(pgid):
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait()


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
    """Launch eyas_common.hf_server (transformers generation, vLLM's response shape) on 127.0.0.1:
    for targets vLLM cannot load here, such as the Kimi-K2.5-shaped fixture. Stop it with `stop`."""
    import sys

    port = port or free_port()
    cmd = [str(python or sys.executable), "-m", "eyas_common.hf_server", "--model", str(model),
           "--port", str(port), *(["--trust-remote-code"] if trust_remote_code else [])]
    return start_server(cmd, port=port, log_path=log_path, env={"HF_HUB_OFFLINE": "1"})


def running_hf_server(model: Path, *, log_path: Path, timeout_s: float = 300, **kwargs):
    """A healthy eyas_common.hf_server for the duration of the `with` block (see `start_hf_server`)."""
    return _healthy(start_hf_server(model, log_path=log_path, **kwargs), timeout_s)
