"""An engine's server process: started in its own process group, waited on until GET /health answers, and
stopped as a group (vLLM forks an engine-core process that can outlive the API server). `eyas-serve launch`
runs the engine this way; the test launchers (eyas_testing.servers) reuse it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT, without /v1
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


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
