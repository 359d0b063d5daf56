#!/usr/bin/env python3
"""The one shell command that runs a stage command where the Makefile's knobs say: in .venv here, in the stage
image here (RUNNER=docker), in the image on one ssh host (HOST=) or as one torchrun node per host (HOSTS=).

The Makefile calls this at recipe time and runs (or, under `make -n`, prints) the line it prints, so a dry run
shows the exact docker and ssh command lines. The knobs come as environment variables named as in the Makefile
(DOCKER, SSH, SSH_ARGS, DATA, GPUS, VARIANT, ...); what one call runs comes as options:

    runner.py --stage train --image REG/eyas-train:TAG --local .venv/bin/eyas-train --module eyas_train.cli \
              [--entrypoint E] [--mount PATH ...] --args 'run --hidden hidden/h ...'

A refusal is printed as `error: MESSAGE` (exit 0, so make's $(shell) sees it and stops with that one line).
Standard library only: it runs wherever make runs, before any venv exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass

# NCCL knobs passed into containers when set (NCCL_P2P_DISABLE=1: multi-GPU Blackwell workstations that hang)
NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG")


class Refused(Exception):
    """Knobs that cannot make a command; the message names the knob to set."""


@dataclass(frozen=True)
class Call:
    stage: str              # synth | extract | train | serve
    image: str              # REGISTRY/eyas-STAGE:TAG
    local: str              # the command in .venv (RUNNER=local), one process
    module: str             # the stage's CLI module for torchrun (empty: the stage never runs under torchrun)
    entrypoint: str         # the image's entrypoint for this command (empty: the image's own)
    mounts: tuple[str, ...] # host paths the command reads, mounted read-only at the same path
    args: str               # the stage's arguments, already shell words


def quote(text: str) -> str:
    """One shell word, single-quoted (the remote shell of ssh undoes exactly this)."""
    return "'" + text.replace("'", "'\\''") + "'"


def words(*parts: str) -> str:
    return " ".join(p.strip() for p in parts if p and p.strip())


def knob(env: dict[str, str], name: str, default: str = "") -> str:
    return env.get(name, default).strip()


def mode_of(env: dict[str, str]) -> str:
    """hosts (HOSTS=), ssh (HOST=), else RUNNER (local or docker)."""
    if knob(env, "HOSTS"):
        return "hosts"
    return "ssh" if knob(env, "HOST") else knob(env, "RUNNER", "local")


def gpu_flag(env: dict[str, str], stage: str) -> str:
    """--gpus for the stages that use GPUs on cu128: GPUS=all | a count | device ids (0,1 or device=2)."""
    gpus = knob(env, "GPUS")
    if not gpus or knob(env, "VARIANT", "cu128") != "cu128" or stage not in knob(env, "GPU_STAGES").split():
        return ""
    # docker would stop on another value only once the image is pulled, with its own words
    if not re.fullmatch(r"all|[1-9][0-9]*|device=[0-9]+(,[0-9]+)*|[0-9]+(,[0-9]+)+", gpus):
        raise Refused(f"GPUS={gpus}: use GPUS=all, a count (GPUS=2), device ids (GPUS=0,1 or GPUS=device=0) or GPUS= for none")
    if "," in gpus or gpus.startswith("device="):
        gpus = quote('"device=' + gpus.removeprefix("device=") + '"')
    return f"--gpus {gpus}"


def docker_run(env: dict[str, str], call: Call, entrypoint: str, args: str) -> str:
    """The stage image with DATA at /data, host network, and the shared/locked memory NCCL and loaders need."""
    nccl = " ".join(f"-e {v}={env[v]}" for v in NCCL_VARS if env.get(v))
    user = knob(env, "RUN_USER")
    mounts = " ".join(f"-v {shlex.quote(f'{os.path.abspath(p)}:{os.path.abspath(p)}:ro')}" for p in call.mounts)
    return words(knob(env, "DOCKER", "docker"), "run --rm --init --network=host --ipc=host", knob(env, "ULIMITS"),
                 gpu_flag(env, call.stage), nccl, f"--user {user}" if user else "",
                 f"-v {shlex.quote(knob(env, 'DATA') + ':/data')} -e EYAS_DATA=/data", mounts, knob(env, "DOCKER_RUN_ARGS"),
                 f"--entrypoint {entrypoint}" if entrypoint else "", call.image, args)


# After SSH_ARGS, where ssh takes the first value of an option, so that SSH_ARGS='-o BatchMode=no' wins: an
# unreachable host or a password prompt fails in seconds with ssh's one line instead of hanging the stage.
SSH_DEFAULTS = "-o BatchMode=yes -o ConnectTimeout=15"


def on_host(env: dict[str, str], host: str, command: str) -> str:
    """COMMAND in a shell on HOST=user@name[:port] over ssh, quoted once."""
    dest, _, port = host.partition(":")
    return words(knob(env, "SSH", "ssh"), f"-p {port}" if port else "", knob(env, "SSH_ARGS"), SSH_DEFAULTS, dest,
                 quote(command))


def host_name(host: str) -> str:
    """The machine of HOST=user@name[:port]."""
    return host.partition(":")[0].rpartition("@")[2]


def torchrun_args(env: dict[str, str], module: str, args: str, host: str = "") -> str:
    """torchrun's options: standalone on one host, or node HOST of HOSTS (c10d rendezvous on the first,
    RDZV_HOST by default its name)."""
    nproc = knob(env, "NPROC", "1")
    hosts = knob(env, "HOSTS").split()
    if not hosts:
        return words(f"--standalone --nproc-per-node {nproc} -m {module}", args)
    rdzv_host = knob(env, "RDZV_HOST") or host_name(hosts[0])
    port = knob(env, "RDZV_PORT", "29500")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise Refused(f"RDZV_PORT={port}: the rendezvous port is a number from 1 to 65535 (default 29500)")
    # --local-addr: the rendezvous tells nodes apart by address and pid; in containers every torchrun has the
    # same pid, and hosts sharing a hostname (or a loopback test) then look like one node that never meets the other
    return words(f"--nnodes {len(hosts)} --nproc-per-node {nproc} --rdzv-backend c10d",
                 f"--rdzv-endpoint {rdzv_host}:{port} --rdzv-id {knob(env, 'RDZV_ID')}",
                 f"--local-addr {host_name(host)}" if host else "", f"-m {module}", args)


def command(env: dict[str, str], call: Call) -> str:
    """The shell line for MODE: local, docker, ssh (pull, then run) or hosts (every node at once)."""
    mode = mode_of(env)
    torch = bool(call.module) and (mode == "hosts" or knob(env, "NPROC", "1") != "1")
    if mode == "local":
        if torch:
            return words(f"{knob(env, 'VENV', '.venv')}/bin/torchrun --standalone",
                         f"--nproc-per-node {knob(env, 'NPROC')} -m {call.module}", call.args)
        return words(call.local, call.args)
    if mode != "docker" and not knob(env, "REGISTRY"):
        raise Refused("HOST= runs pull the image: set REGISTRY=host:port (and make push-STAGE first)")

    def pull_run(host: str = "") -> str:  # the image's command line (pulled first on an ssh host)
        entrypoint, args = ("torchrun", torchrun_args(env, call.module, call.args, host)) if torch else \
            (call.entrypoint, call.args)
        run = docker_run(env, call, entrypoint, args)
        return run if mode == "docker" else f"{knob(env, 'DOCKER', 'docker')} pull {call.image} && {run}"

    if mode == "docker":
        return pull_run()
    if mode == "ssh":
        return on_host(env, knob(env, "HOST"), pull_run())
    if call.stage != "train":
        raise Refused("HOSTS= runs make train only (one torchrun node per host): use HOST=user@name[:port] here")
    # every node at once; the line fails when any node fails
    nodes = " ".join(f'{on_host(env, h, pull_run(h))} & pids="$pids $!";' for h in knob(env, "HOSTS").split())
    return f"rc=0; pids=; {nodes} for p in $pids; do wait $p || rc=1; done; exit $rc"


def parse(argv: list[str]) -> Call:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", required=True)
    p.add_argument("--image", required=True)
    p.add_argument("--local", default="", help="the one-process command in .venv")
    p.add_argument("--module", default="", help="the CLI module torchrun starts (NPROC > 1, HOSTS=)")
    p.add_argument("--entrypoint", default="", help="the image entrypoint to use instead of the image's own")
    p.add_argument("--mount", action="append", default=[], help="a host path the command reads (repeatable)")
    p.add_argument("--args", default="", help="the stage's arguments, as shell text (put in the line as given)")
    o = p.parse_args(argv)
    return Call(o.stage, o.image, o.local, o.module, o.entrypoint, tuple(m for m in o.mount if m), o.args)


def main(argv: list[str]) -> int:
    call = parse(argv)
    try:
        print(command(dict(os.environ), call))
    except Refused as e:
        print(f"error: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
