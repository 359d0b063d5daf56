"""Real container machinery on loopback for the image tests: dockerd, a registry, sshd.

Each daemon runs as a child of the test session in its own process group and is stopped by pid. State
that is worth keeping between runs on one machine (dockerd's images and build cache, the registry's
blobs) lives under EYAS_IMAGE_STATE (default /var/lib/eyas-images); a fresh machine starts empty.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from eyas_testing.servers import free_port

STATE = Path(os.environ.get("EYAS_IMAGE_STATE", "/var/lib/eyas-images"))
DOCKER_SOCK = Path("/run/eyas-images/docker.sock")


@dataclass(frozen=True)
class Engines:
    docker_env: dict[str, str]      # the environment for `docker` / `make` talking to our dockerd
    registry: str                   # host:port of the registry
    ssh_hosts: tuple[str, ...]      # user@host:port of each sshd (127.0.0.1, 127.0.0.2): make HOST= / HOSTS=
    ssh_args: str                   # make SSH_ARGS=

    @property
    def ssh_host(self) -> str:
        return self.ssh_hosts[0]


def _wait(what: str, ok, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; its log {log}:\n{log.read_text()[-3000:]}")
        if ok():
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s; its log {log}:\n{log.read_text()[-3000:]}")


@contextmanager
def _daemon(what: str, cmd: list[str], log: Path, ready) -> Iterator[subprocess.Popen]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        _wait(what, ready, proc, log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _docker_ready(env: dict[str, str]) -> bool:
    return subprocess.run(["docker", "info"], env=env, capture_output=True).returncode == 0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _ssh_ready(address: str, port: int, key: Path) -> bool:
    cmd = ["ssh", "-p", str(port), "-i", str(key), *SSH_OPTS, f"root@{address}", "true"]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


SSH_OPTS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
            "-o", "LogLevel=ERROR"]


def _sshd_config(work: Path, address: str, port: int) -> tuple[Path, Path]:
    """A throwaway host key (one per address) and client key (shared), and a config that lets only that key
    in, as root, on one loopback address."""
    for name in (f"host_key_{address}", "client_key"):
        if not (work / name).exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / name)], check=True)
    shutil.copy(work / "client_key.pub", work / "authorized_keys")
    config = work / f"sshd_config_{address}"
    config.write_text(
        f"Port {port}\nListenAddress {address}\nHostKey {work / f'host_key_{address}'}\n"
        f"AuthorizedKeysFile {work / 'authorized_keys'}\nPidFile {work / f'sshd_{address}.pid'}\n"
        "UsePAM no\nStrictModes no\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n"
        # a remote `docker` talks to the test's dockerd, as it would to a host's own
        f"SetEnv DOCKER_HOST=unix://{DOCKER_SOCK}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)
    return config, work / "client_key"


@contextmanager
def running_engines(work: Path) -> Iterator[Engines]:
    """dockerd (overlay2, no iptables or bridge: builds and containers use the host network), a
    registry on 127.0.0.1 and two sshd, on 127.0.0.1 and 127.0.0.2 (two "hosts" sharing the docker
    engine and the data folder), all stopped on exit."""
    DOCKER_SOCK.parent.mkdir(parents=True, exist_ok=True)
    (STATE / "docker").mkdir(parents=True, exist_ok=True)
    (STATE / "registry").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DOCKER_HOST": f"unix://{DOCKER_SOCK}"}
    reg_port = free_port()
    sshd = {address: free_port() for address in ("127.0.0.1", "127.0.0.2")}
    reg_config = work / "registry.yml"
    reg_config.write_text(json.dumps({
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(STATE / "registry")}},
        "http": {"addr": f"127.0.0.1:{reg_port}"},
    }))
    with ExitStack() as stack:
        stack.enter_context(_daemon("dockerd", [
            "dockerd", "--data-root", str(STATE / "docker"), "--exec-root", str(DOCKER_SOCK.parent / "exec"),
            "--host", f"unix://{DOCKER_SOCK}", "--pidfile", str(DOCKER_SOCK.parent / "dockerd.pid"),
            "--storage-driver", "overlay2", "--iptables=false", "--ip6tables=false", "--bridge=none",
        ], work / "dockerd.log", lambda: _docker_ready(env)))
        stack.enter_context(_daemon("registry", ["docker-registry", "serve", str(reg_config)], work / "registry.log",
                                    lambda: _http_ok(f"http://127.0.0.1:{reg_port}/v2/")))
        for address, port in sshd.items():
            config, key = _sshd_config(work, address, port)
            stack.enter_context(_daemon(f"sshd {address}", ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                                        work / f"sshd_{address}.log",
                                        lambda a=address, p=port, k=key: _ssh_ready(a, p, k)))
        yield Engines(docker_env=env, registry=f"127.0.0.1:{reg_port}",
                      ssh_hosts=tuple(f"root@{a}:{p}" for a, p in sshd.items()),
                      ssh_args=" ".join(["-i", str(key), *SSH_OPTS]))


def registry_tags(registry: str, repo: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"http://{registry}/v2/{repo}/tags/list", timeout=10) as r:
            return json.load(r).get("tags") or []
    except OSError:
        return []
