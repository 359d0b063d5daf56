"""docker/runner.py, the one place a stage command is sent to its runner: in .venv, in the image here, in the image
on an ssh host, or one torchrun node per host. Its lines are checked word by word here (the Makefile's dry-run
tests check the same lines through make; tests/images runs them against a real docker, registry and sshd)."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("runner", REPO / "docker/runner.py")
runner = sys.modules["runner"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

BASE = {"DOCKER": "docker", "SSH": "ssh", "DATA": "/data/eagle3", "VARIANT": "cu128", "GPUS": "all",
        "GPU_STAGES": "extract train serve", "REGISTRY": "reg:5000", "RDZV_PORT": "29500", "RDZV_ID": "eyas-d",
        "NPROC": "1", "VENV": ".venv"}
IMAGE = "reg:5000/eyas-train:abc"


def call(stage="train", args="run --hidden hidden/h", module="eyas_train.cli", entrypoint="", mounts=()):
    return runner.Call(stage, IMAGE, ".venv/bin/eyas-" + stage, module, entrypoint, tuple(mounts), args)


def line(knobs=None, **kw) -> str:
    return runner.command({**BASE, **(knobs or {})}, call(**kw))


def test_local_runs_in_the_venv_and_under_torchrun_for_several_processes():
    assert line() == ".venv/bin/eyas-train run --hidden hidden/h"
    assert line({"NPROC": "2"}) == (".venv/bin/torchrun --standalone --nproc-per-node 2 -m eyas_train.cli "
                                    "run --hidden hidden/h")
    # a command without a torchrun module (a local vLLM extraction places its own workers) stays one process
    assert line({"NPROC": "2"}, module="") == ".venv/bin/eyas-train run --hidden hidden/h"


@pytest.mark.parametrize("gpus, stage, variant, flag", [
    ("all", "train", "cu128", "--gpus all"),
    ("4", "extract", "cu128", "--gpus 4"),
    ("0,1", "serve", "cu128", """--gpus '"device=0,1"'"""),
    ("device=2", "train", "cu128", """--gpus '"device=2"'"""),
    ("all", "synth", "cu128", ""),   # synth runs where no GPU runtime may be installed
    ("all", "train", "cpu", ""),
    ("", "train", "cu128", ""),
])
def test_gpus_reach_the_stages_that_use_them(gpus, stage, variant, flag):
    out = line({"RUNNER": "docker", "GPUS": gpus, "VARIANT": variant}, stage=stage, module="")
    assert ("--gpus" in out) == bool(flag)
    if flag:
        assert f" {flag} " in out


def test_docker_here_mounts_data_and_what_the_command_reads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = line({"RUNNER": "docker", "NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "", "RUN_USER": "1000:1000",
                "ULIMITS": "--ulimit memlock=-1"}, mounts=("models/K",))
    assert shlex.split(out) == shlex.split(
        "docker run --rm --init --network=host --ipc=host --ulimit memlock=-1 --gpus all -e NCCL_P2P_DISABLE=1 "
        f"--user 1000:1000 -v /data/eagle3:/data -e EYAS_DATA=/data -v {tmp_path}/models/K:{tmp_path}/models/K:ro "
        f"{IMAGE} run --hidden hidden/h")


def test_ssh_pulls_then_runs_and_the_remote_shell_gets_the_words_back():
    args = "run --name 'it'\"'\"'s' --note \"$HOME\""  # quotes and a $ the remote shell must see unchanged
    out = line({"HOST": "me@gpu-1:2222", "SSH_ARGS": "-i /k"}, args=args, module="")
    words = shlex.split(out)
    assert words[:9] == ["ssh", "-p", "2222", "-i", "/k", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15"]
    assert words[9] == "me@gpu-1" and len(words) == 11
    remote = words[10]
    assert remote.startswith(f"docker pull {IMAGE} && docker run ") and remote.endswith(f"{IMAGE} {args}")


def test_hosts_start_one_node_each_and_fail_when_any_fails(tmp_path):
    out = line({"HOSTS": "u@a u@b:2200", "NPROC": "8"})
    nodes = [shlex.split(part)[-1] for part in out.split(" & ")[:2]]
    for node, name in zip(nodes, ("a", "b")):  # each node named by its own address (containers share pid 7)
        assert "--entrypoint torchrun" in node and node.endswith(
            f"{IMAGE} --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint a:29500 --rdzv-id eyas-d "
            f"--local-addr {name} -m eyas_train.cli run --hidden hidden/h")
    assert line({"HOSTS": "u@a u@b", "RDZV_HOST": "10.0.0.5"}).count("--rdzv-endpoint 10.0.0.5:29500") == 2
    # the line itself, run by bash with an ssh that fails on host b only: the whole line fails
    fake_ssh = tmp_path / "ssh"
    fake_ssh.write_text('#!/bin/sh\ncase "$*" in *u@b*) exit 3;; esac\nexit 0\n')
    fake_ssh.chmod(0o755)
    ok = line({"HOSTS": "u@a u@c", "SSH": str(fake_ssh)})
    bad = line({"HOSTS": "u@a u@b", "SSH": str(fake_ssh)})
    assert subprocess.run(["bash", "-c", ok]).returncode == 0
    assert subprocess.run(["bash", "-c", bad]).returncode == 1


@pytest.mark.parametrize("knobs, stage, says", [
    ({"HOST": "me@box", "REGISTRY": ""}, "train", "HOST= runs pull the image: set REGISTRY"),
    ({"HOSTS": "a b"}, "synth", "HOSTS= runs make train only"),
    ({"RUNNER": "docker", "GPUS": "two"}, "train", "GPUS=two: use GPUS=all, a count (GPUS=2), device ids"),
    ({"RUNNER": "docker", "GPUS": "0"}, "extract", "GPUS=0: use GPUS=all"),
])
def test_refusals_are_one_error_line(knobs, stage, says):
    argv = ["--stage", stage, "--image", IMAGE, "--local", "x", "--args", "run"]
    r = subprocess.run([sys.executable, str(REPO / "docker/runner.py"), *argv], capture_output=True, text=True,
                       env={**BASE, **knobs})
    assert r.returncode == 0 and r.stdout.startswith("error: ") and says in r.stdout and r.stdout.count("\n") == 1


@pytest.mark.parametrize("port", ["70000", "0", "x"])
def test_a_rendezvous_port_that_is_not_one_is_refused(port):
    with pytest.raises(runner.Refused, match=f"RDZV_PORT={port}: the rendezvous port is a number from 1 to 65535"):
        line({"HOSTS": "u@a u@b", "RDZV_PORT": port})


def test_make_stops_on_a_refusal_with_the_runners_line():
    r = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "-n", "synth", "HOSTS=a b", "N=1",
                        "PROMPTS=/p", "MODEL=/m", "NAME=s", "REGISTRY=r:5000", "SETTINGS=/dev/null"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "HOSTS= runs make train only" in r.stderr and "docker" not in r.stdout
