"""The Makefile's image and remote-run targets, by dry run (`make -n`): the exact docker and ssh command
lines for the cu128 variant on several GPUs, which cannot run here; the settings file and `make settings`;
the refusals of clean-remote; hadolint on every Dockerfile. (tests/images runs the cpu images for real.)"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, dry_lines, make, remote

SSH_DEFAULTS = "-o BatchMode=yes -o ConnectTimeout=15"  # after SSH_ARGS on every ssh line: fail fast, never prompt

HADOLINT = Path(sys.executable).parent / "hadolint"
DOCKERFILES = sorted([REPO / "docker/Dockerfile", *REPO.glob("stages/*/Dockerfile")])
GPU_RUN = ("docker run --rm --init --network=host --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
           "--gpus 4 -e NCCL_P2P_DISABLE=1 -v /data/eagle3:/data -e EYAS_DATA=/data -v /models/K:/models/K:ro")


def test_train_over_ssh_on_several_gpus_is_one_exact_command():
    (line,) = dry_lines("train", HOST="ubuntu@gpu-box-2:2222", HIDDEN="hidden/h", MODEL="/models/K", NAME="d",
                        NPROC="4", GPUS="4", NCCL_P2P_DISABLE="1", SSH_ARGS="-i /keys/gpu")
    image = "reg.example:5000/team/eyas-train:abc123"
    assert remote(line) == [
        "ssh", "-p", "2222", "-i", "/keys/gpu", *SSH_DEFAULTS.split(), "ubuntu@gpu-box-2",
        f"docker pull {image} && {GPU_RUN} --entrypoint torchrun {image} --standalone --nproc-per-node 4 "
        "-m eyas_train.cli run --hidden hidden/h --model /models/K --name d"]


def test_extract_with_docker_here_on_listed_gpus():
    (line,) = dry_lines("extract", RUNNER="docker", SYNTH="synth/s", MODEL="/models/K", NAME="h", GPUS="0,1",
                        DATA="/mnt/eagle3", EXTRACT_ARGS="--teacher topk")
    assert shlex.split(line) == shlex.split(
        "docker run --rm --init --network=host --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
        "--gpus '\"device=0,1\"' -v /mnt/eagle3:/data -e EYAS_DATA=/data -v /models/K:/models/K:ro "
        "reg.example:5000/team/eyas-extract:abc123 run --synth synth/s --model /models/K --name h --backend hf "
        "--teacher topk")


def test_synth_over_ssh_runs_then_validates_without_gpus():
    # GPUS=all is the default: synth still asks for none
    lines = dry_lines("synth", HOST="me@inference-1", N="10000", PROMPTS="/data/prompts.jsonl",
                      MODEL="/models/K", NAME="synth_10k", SERVER="http://a:8000 http://b:8000")
    image = "reg.example:5000/team/eyas-synth:abc123"
    run = (f"docker pull {image} && docker run --rm --init --network=host --ipc=host --ulimit memlock=-1 "
           "--ulimit stack=67108864 -v /data/eagle3:/data -e EYAS_DATA=/data "
           "-v /models/K:/models/K:ro -v /data/prompts.jsonl:/data/prompts.jsonl:ro " + image)
    assert [remote(x) for x in lines] == [
        ["ssh", *SSH_DEFAULTS.split(), "me@inference-1",
         f"{run} run --prompts /data/prompts.jsonl --name synth_10k --model /models/K --server http://a:8000 "
         "--server http://b:8000 --n 10000 --max-tokens 4096 --temperature 0.6 --concurrency 128"],
        ["ssh", *SSH_DEFAULTS.split(), "me@inference-1", f"{run} validate synth_10k"],
    ]


def test_training_across_hosts_starts_one_torchrun_node_per_host():
    (line,) = dry_lines("train", HOSTS="u@gpu-a u@gpu-b:2200", NPROC="8", HIDDEN="hidden/h", MODEL="/models/K",
                        NAME="d", GPUS="all", NCCL_P2P_DISABLE="", NCCL_SOCKET_IFNAME="eth1")
    image = "reg.example:5000/team/eyas-train:abc123"
    def node(name: str) -> str:  # each node named by its host (--local-addr): containers share pid and hostname
        return (f"docker pull {image} && docker run --rm --init --network=host --ipc=host --ulimit memlock=-1 "
                "--ulimit stack=67108864 --gpus all -e NCCL_SOCKET_IFNAME=eth1 -v /data/eagle3:/data "
                f"-e EYAS_DATA=/data -v /models/K:/models/K:ro --entrypoint torchrun {image} --nnodes 2 "
                "--nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu-a:29500 --rdzv-id eyas-d "
                f"--local-addr {name} -m eyas_train.cli run --hidden hidden/h --model /models/K --name d")
    opts = SSH_DEFAULTS
    assert f"ssh {opts} u@gpu-a '{node('gpu-a')}' & " in line
    assert f"ssh -p 2200 {opts} u@gpu-b '{node('gpu-b')}' & " in line
    assert line.rstrip().endswith("for p in $pids; do wait $p || rc=1; done; exit $rc")


def test_cu128_base_build_compiles_flash_attn_for_hopper_and_blackwell():
    lines = dry_lines("build-train", VARIANT="cu128", MAX_JOBS="6")
    builds = [shlex.split(x) for x in lines if x.startswith("docker build")]
    assert [b[b.index("--target") + 1] if "--target" in b else b[-1] for b in builds] == ["slim", "cu128", "."]
    base = builds[1]
    for arg in ("FLASH_ATTN_VERSION=2.8.3", "MAX_JOBS=6", "TORCH_VERSION=2.13.0+cu128",
                "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128",
                "CUDA_DEVEL=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04"):
        assert base[base.index(arg) - 1] == "--build-arg", arg
    assert base[-3:] == ["-t", "reg.example:5000/team/eyas-base:cu128", "docker"]
    assert "--network=host" in base
    assert lines[-1].split() == ("docker build --network=host -f stages/03_train/Dockerfile --build-arg "
                     "BASE=reg.example:5000/team/eyas-base:cu128 --build-arg EYAS_IMAGE_TAG=eyas-train:abc123 "
                     "-t reg.example:5000/team/eyas-train:abc123 .").split()
    dockerfile = (REPO / "docker/Dockerfile").read_text()
    assert 'FLASH_ATTN_CUDA_ARCHS="90;100;120" FLASH_ATTENTION_FORCE_BUILD=TRUE' in dockerfile
    assert "--no-build-isolation" in dockerfile


def test_push_builds_first_and_every_stage_has_build_push_run_rules():
    lines = dry_lines("push-extract")
    assert lines[-1] == "docker push reg.example:5000/team/eyas-extract:abc123"
    assert any("-f stages/02_extract/Dockerfile" in x for x in lines)
    stages = [p.parent.name.split("_", 1)[1] for p in REPO.glob("stages/*/Dockerfile")]
    out = "\n".join(dry_lines("push"))
    for stage in stages:
        assert f"docker push reg.example:5000/team/eyas-{stage}:abc123" in out
    assert dry_lines("run-train", RUNNER="docker", VARIANT="cpu", ARGS="eval --help")[-1].endswith(
        "eyas-train:abc123 eval --help")


def test_clean_remote_is_a_dry_run_unless_yes():
    # the last line is the command; the lines before it are the guards of DATASET
    dry = dry_lines("clean-remote", HOST="root@box:2222", DATASET="synth/synth_25k")[-1]
    yes = dry_lines("clean-remote", HOST="root@box:2222", DATASET="synth/synth_25k", YES="1")[-1]
    assert remote(dry)[:3] == ["ssh", "-p", "2222"] and remote(dry)[-1].endswith(
        "--entrypoint eyas-data reg.example:5000/team/eyas-synth:abc123 rm synth/synth_25k --dry-run")
    assert remote(yes)[-1].endswith("rm synth/synth_25k --yes")


@pytest.mark.parametrize("dataset, says", [
    ("", "set DATASET=KIND/NAME"),
    ("/data/eagle3/synth/x", "is an absolute path"),
    ("..", "is not a KIND/NAME inside the data root"),
    ("synth/../../etc", "is not a KIND/NAME inside the data root"),
])
def test_clean_remote_refuses_paths_outside_the_data_root(dataset, says):
    r = make("clean-remote", HOST="root@box", DATASET=dataset, YES="1", SSH="false")
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("knobs, says", [
    ({"RUNNER": "podman"}, "RUNNER=podman: use RUNNER=local"),
    ({"VARIANT": "rocm"}, "VARIANT=rocm: use VARIANT=cu128 or VARIANT=cpu"),
    ({"HOST": "me@box", "REGISTRY": ""}, "HOST= runs pull the image: set REGISTRY"),
])
def test_bad_knobs_get_one_line(knobs, says):
    r = make("-n", "train", HIDDEN="hidden/h", MODEL="/m", NAME="d", **knobs)
    assert r.returncode == 2 and says in r.stderr


def test_settings_file_supplies_the_deployment_and_make_settings_says_where(tmp_path):
    settings = tmp_path / "settings.mk"
    settings.write_text("MODEL ?= /models/Kimi-K2.5\nSERVER ?= http://gpu1:8000\nPROMPTS ?= /data/p.jsonl\n"
                        "NAME ?= synth_10k\nREGISTRY ?= reg.example:5000/team\nHOST ?= me@inference-1\n")
    env = {**os.environ, "GPUS": "2"}
    # REGISTRY comes from the settings file here, not from FIXED
    knobs = {"SETTINGS": str(settings), "REGISTRY": None}
    r = make("-n", "synth", N="10000", env=env, **knobs)
    assert r.returncode == 0, r.stderr
    assert f"ssh {SSH_DEFAULTS} me@inference-1 'docker pull reg.example:5000/team/eyas-synth:abc123 && " in r.stdout
    assert "--server http://gpu1:8000 --n 10000" in r.stdout and "--gpus" not in r.stdout  # synth needs no GPU
    r = make("settings", N="10000", env=env, **knobs)
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert rows["MODEL"].split()[1:] == ["/models/Kimi-K2.5", f"({settings})"]
    assert rows["REGISTRY"].split()[1:] == ["reg.example:5000/team", f"({settings})"]
    assert rows["N"].endswith("(command line)") and rows["GPUS"].endswith("(environment)")
    assert rows["DATA"].split()[1:] == ["/data/eagle3", "(default)"]


def test_help_lists_every_target_with_its_knobs():
    out = make("help").stdout
    for target in ("synth", "extract", "train", "build-%", "push-%", "run-%", "build", "push", "clean-remote",
                   "settings", "test-images", "demo", "test"):
        assert f" {target} " in out.replace("\x1b[36m", " ").replace("\x1b[0m", " "), target
    assert "HOST" in out and "REGISTRY" in out and "DATASET=KIND/NAME" in out
    assert make().stdout == out  # help is the default goal


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_passes(dockerfile):
    r = subprocess.run([str(HADOLINT), "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_eyas_data_rm_dry_run_checks_like_rm_and_deletes_nothing(tmp_path, monkeypatch):
    # what `make clean-remote` runs in the image without YES=1
    from click.testing import CliRunner

    from eyas_common.cli import main as data_cli

    monkeypatch.setenv("EYAS_DATA", str(tmp_path / "root"))
    (tmp_path / "root/synth/bad").mkdir(parents=True)
    (tmp_path / "root/synth/bad/manifest.json").write_text("{}")
    (tmp_path / "root/synth/escape").symlink_to("../..")
    r = CliRunner().invoke(data_cli, ["rm", "synth/bad", "--dry-run"])
    assert r.exit_code == 0 and "would delete" in r.output and (tmp_path / "root/synth/bad/manifest.json").exists()
    # a link is never followed: its removal is the link alone, and a dry run removes nothing
    r = CliRunner().invoke(data_cli, ["rm", "synth/escape", "--dry-run"])
    assert r.exit_code == 0 and "would delete the link" in r.output, r.output
    assert (tmp_path / "root/synth/escape").is_symlink() and (tmp_path / "root").is_dir()
