"""The images, built and run for real on this machine (`make test-images`, as root): the cpu base and every
stage image build; `make push` reaches a registry; `make synth HOST=...` pulls the synth image and runs it
over ssh against real vLLM; extract and train run from their images and record the image tag; training on two
ssh hosts (one torchrun node each) equals one process; `make pipeline` streams synth, extract and train across
the two ssh hosts under a disk budget; a patch to
one stage rebuilds only that image's last layers; `make clean-remote` deletes one dataset and refuses
paths outside the data root. The tests run in file order, each on what the previous ones left."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas_common.chat import load_tokenizer
from eyas_common.contract import Dataset
from eyas_testing.fixture import write_prompts_jsonl
from eyas_testing.stub import start_stub
from eyas_testing.servers import VllmServer, free_port, start_vllm, stop, wait_healthy

from engines import Engines, registry_tags, running_engines
from helpers import rendering_answer

REPO = Path(__file__).resolve().parents[2]
OS_IMAGE = "eyas-os:bookworm"
EYAS_UID = 1000  # the images' user


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Engines:
    with running_engines(tmp_path_factory.mktemp("engines")) as e:
        yield e


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """This working tree as one clean commit, so that a test can patch it and see `-dirty` tags."""
    dest = tmp_path_factory.mktemp("repo")
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.name=eyas-test", "-c", "user.email=test@eyas.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "snapshot"], cwd=dest, check=True)
    return dest


@pytest.fixture(scope="module")
def vllm(fixture_target, tmp_path_factory) -> VllmServer:
    """vLLM on the fixture target, started early (it takes a minute or two) and awaited where used."""
    server = start_vllm(fixture_target, log_path=tmp_path_factory.mktemp("vllm") / "server.log",
                        extra_args=["--reasoning-parser", "kimi_k2"])
    try:
        yield server
    finally:
        stop(server)


@pytest.fixture(scope="module")
def model(fixture_target, tmp_path_factory) -> Path:
    """The fixture target as a host keeps a model: readable by every user, the images' eyas too (the
    cache writes model.safetensors 0600, atomically)."""
    dest = tmp_path_factory.mktemp("models") / fixture_target.name
    shutil.copytree(fixture_target, dest)
    for path in [dest, *dest.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


@pytest.fixture(scope="module")
def state() -> dict:
    return {}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The data volume, owned by the images' user as on a real host."""
    root = tmp_path_factory.mktemp("volume") / "eagle3"
    root.mkdir()
    os.chown(root, EYAS_UID, EYAS_UID)
    return root


def ulimits() -> str:
    """The Makefile's default ULIMITS, less unlimited locked memory where this machine's hard limit
    cannot be raised (then runc refuses the container); GPU hosts keep it."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return "--ulimit stack=67108864" + ("" if hard != resource.RLIM_INFINITY else " --ulimit memlock=-1")


def make(repo: Path, engines: Engines, *targets: str, check: bool = True, **knobs: str) -> subprocess.CompletedProcess:
    base = {"VARIANT": "cpu", "BASE_OS": OS_IMAGE, "REGISTRY": engines.registry, "SSH_ARGS": engines.ssh_args,
            "ULIMITS": ulimits()}
    cmd = ["make", "--no-print-directory", "-C", str(repo), *targets, *(f"{k}={v}" for k, v in {**base, **knobs}.items())]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=engines.docker_env, capture_output=True, text=True)
    print(f"make {' '.join(targets)}: {time.monotonic() - t0:.0f} s, rc {r.returncode}")
    if check and r.returncode != 0:
        pytest.fail(f"make {' '.join(targets)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-6000:]}", pytrace=False)
    return r


def docker(engines: Engines, *args: str) -> str:
    r = subprocess.run(["docker", *args], env=engines.docker_env, capture_output=True, text=True)
    assert r.returncode == 0, f"docker {' '.join(args)}: {r.stderr[-2000:]}"
    return r.stdout.strip()


def inspect(engines: Engines, image: str) -> dict:
    return json.loads(docker(engines, "image", "inspect", image))[0]


def stage_names(repo: Path) -> list[str]:
    return [p.parent.name.split("_", 1)[1] for p in sorted(repo.glob("stages/*/Dockerfile"))]


def tag_of(repo: Path, suffix: str = "") -> str:
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, check=True, capture_output=True,
                         text=True).stdout.strip()
    return f"{sha}{suffix}-cpu"


def manifest(root: Path, ref: str) -> dict:
    return Dataset.parse(ref, root=root).read_manifest()


def test_cpu_base_and_every_stage_image_build(repo, engines, state):
    make(repo, engines, "os-image", OS_IMAGE=OS_IMAGE)
    make(repo, engines, "build")
    tag = state["tag"] = tag_of(repo)
    images = {s: f"{engines.registry}/eyas-{s}:{tag}" for s in stage_names(repo)}
    assert {"synth", "extract", "train"} <= images.keys()
    for stage, image in images.items():
        assert inspect(engines, image)["Config"]["Env"].count(f"EYAS_IMAGE_TAG=eyas-{stage}:{tag}") == 1
    # torch images import torch and the stage; the synth image has no torch and stays small
    docker(engines, "run", "--rm", "--entrypoint", "python", images["train"], "-c", "import torch, eyas_common, eyas_train")
    no_torch = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    docker(engines, "run", "--rm", "--entrypoint", "python", images["synth"], "-c", no_torch)
    sizes = {s: inspect(engines, i)["Size"] for s, i in images.items()}
    print("image sizes (MB):", {s: round(b / 1e6) for s, b in sizes.items()})
    assert sizes["synth"] < sizes["train"] / 2
    assert docker(engines, "run", "--rm", "--entrypoint", "id", images["train"], "-u") == str(EYAS_UID)
    state["images"] = images


def test_make_push_reaches_the_registry(repo, engines, state, vllm):
    # (vllm starts up meanwhile, for the next test)
    make(repo, engines, "push")
    for stage in state["images"]:
        assert state["tag"] in registry_tags(engines.registry, f"eyas-{stage}"), stage


def test_synth_over_ssh_pulls_and_writes_a_valid_dataset(repo, engines, state, data, model, vllm, tmp_path):
    # drop the tag the run uses (a second tag keeps the layers and the build cache): the run over ssh
    # must get it from the registry
    docker(engines, "tag", state["images"]["synth"], "eyas-test-keep:synth")
    docker(engines, "rmi", state["images"]["synth"])
    prompts = tmp_path / "prompts.jsonl"
    write_prompts_jsonl(prompts, 8, 3)
    wait_healthy(vllm, 600)
    r = make(repo, engines, "synth", HOST=engines.ssh_host, RUNNER="docker", DATA=str(data),
             MODEL=str(model), PROMPTS=str(prompts), SERVER=vllm.url, NAME="s1", N="8",
             MAX_TOKENS="200", CONCURRENCY="8")
    stop(vllm)  # done with it: the cores go to extract and train
    assert f"Downloaded newer image for {state['images']['synth']}" in r.stdout
    m = manifest(data, "synth/s1")
    assert m["status"] == "complete" and m["producer"]["image"] == f"eyas-synth:{state['tag']}"
    # the code version is the commit's, as a checkout of it records it (the tag less its variant)
    assert m["producer"]["git"] == state["tag"].removesuffix("-cpu")
    assert sum(1 for _ in open(data / "synth/s1/samples.jsonl")) == 8
    # and this checkout's own validator agrees with the one in the image
    venv_bin = Path(sys.executable).parent
    v = subprocess.run([str(venv_bin / "eyas-synth"), "validate", "s1"], env={**os.environ, "EYAS_DATA": str(data)},
                       capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


def test_extract_and_train_run_from_their_images(repo, engines, state, data, model):
    # extraction with RUNNER=docker on this machine, training on the "other host" over ssh
    make(repo, engines, "extract", RUNNER="docker", DATA=str(data), SYNTH="synth/s1", MODEL=str(model),
         NAME="h1")
    make(repo, engines, "train", HOST=engines.ssh_host, DATA=str(data), HIDDEN="hidden/h1",
         MODEL=str(model), NAME="d1",
         TRAIN_ARGS="--epochs 1 --draft-vocab 256 --ttt-steps 2 --batch-size 4 --log-every 1")
    hidden, draft = manifest(data, "hidden/h1"), manifest(data, "drafts/d1")
    assert hidden["status"] == draft["status"] == "complete"
    assert hidden["producer"]["image"] == f"eyas-extract:{state['tag']}"
    assert draft["producer"]["image"] == f"eyas-train:{state['tag']}"
    assert [i["ref"] for i in draft["inputs"]] == ["hidden/h1", "synth/s1"]  # lineage back to the samples
    assert (data / "drafts/d1/config.json").is_file() and (data / "drafts/d1/model.safetensors").is_file()


def test_training_on_two_hosts_equals_one_process(repo, engines, data, model):
    """make train HOSTS="a b" NPROC=1: one torchrun node per ssh host (127.0.0.1 and 127.0.0.2), joined by the
    c10d rendezvous on the first, gloo between them, gives the draft one process gives with the same global
    batch. (Validation is set to 2 samples: its default count is rounded to the number of processes; fp32:
    bf16 products, --precision auto on a CPU with bf16, round each rank's partial sums apart.)"""
    args = "--epochs 1 --draft-vocab 256 --ttt-steps 2 --batch-size 4 --val-samples 2 --log-every 1 --precision fp32"
    common = dict(DATA=str(data), HIDDEN="hidden/h1", MODEL=str(model), TRAIN_ARGS=args)
    make(repo, engines, "train", HOST=engines.ssh_hosts[1], NAME="one", **common)
    r = make(repo, engines, "train", HOSTS=" ".join(engines.ssh_hosts), NPROC="1", NAME="two",
             RDZV_PORT=str(free_port()), **common)
    one, two = manifest(data, "drafts/one"), manifest(data, "drafts/two")
    assert two["status"] == "complete" and two["params"]["world"] == 2 and one["params"]["world"] == 1, r.stdout
    a, b = (load_file(data / f"drafts/{d}/model.safetensors") for d in ("one", "two"))
    assert a.keys() == b.keys()
    for name in a:  # equal up to the order of float sums
        torch.testing.assert_close(a[name].float(), b[name].float(), atol=2e-5, rtol=1e-4, msg=name)


def test_pipeline_streams_across_two_ssh_hosts_under_a_disk_budget(repo, engines, data, model, tmp_path):
    """make pipeline with each stage on an ssh host (synth and train on one, extract on the other), from their
    images, streaming through the shared data folder: each follows the one before, under a disk budget."""
    prompts = write_prompts_jsonl(tmp_path / "prompts.jsonl", 24, 3)
    hosts = engines.ssh_hosts
    with start_stub(answer=rendering_answer(load_tokenizer(model)), latency_s=0.5) as stub:
        make(repo, engines, "pipeline", SYNTH_HOST=hosts[0], EXTRACT_HOST=hosts[1], TRAIN_HOST=hosts[0],
             DATA=str(data), MODEL=str(model), PROMPTS=str(prompts), SERVER=stub.url, NAME="p1", N="24",
             MAX_TOKENS="40", TEMPERATURE="0", CONCURRENCY="1", SYNTH_ARGS="--seed 0", DISK_BUDGET="2000000",
             EXTRACT_ARGS="--shard-samples 3 --poll-seconds 0.2",
             TRAIN_ARGS="--epochs 1 --draft-vocab 256 --ttt-steps 2 --batch-size 4 --val-samples 2 "
                        "--window-shards 2 --ckpt-every 1 --poll-seconds 0.2 --patience 0")
    for ref, stage in (("synth/p1", "synth"), ("hidden/p1", "extract"), ("drafts/p1", "train")):
        m = manifest(data, ref)
        assert m["status"] == "complete" and m["producer"]["image"].startswith(f"eyas-{stage}:"), ref
    shards = [e for e in manifest(data, "hidden/p1")["files"] if e["name"].startswith("shard-")]
    assert shards and all(e.get("consumed", {}).get("by") == "drafts/p1" for e in shards)


def layers(engines: Engines, image: str) -> list[str]:
    return inspect(engines, image)["RootFS"]["Layers"]


def test_a_patch_to_train_rebuilds_only_its_last_layers(repo, engines, state):
    images = state["images"]
    before = {s: inspect(engines, i)["Id"] for s, i in images.items()}
    train_layers = layers(engines, images["train"])
    with open(repo / "stages/03_train/eyas_train/__init__.py", "a") as f:
        f.write("# a one-line patch\n")
    t0 = time.monotonic()
    make(repo, engines, "build-train")
    print(f"rebuild of train after a one-line patch: {time.monotonic() - t0:.0f} s")
    patched = f"{engines.registry}/eyas-train:{tag_of(repo, '-dirty')}"
    new_layers = layers(engines, patched)
    # base and common layers reused; the stage's COPY and its pip install are new
    assert new_layers[:-2] == train_layers[:-2] and len(new_layers) == len(train_layers)
    assert new_layers[-2] != train_layers[-2] and new_layers[-1] != train_layers[-1]
    # the other stages, rebuilt at their tag from the patched tree, come out identical
    others = [s for s in images if s != "train"]
    make(repo, engines, *(f"build-{s}" for s in others), TAG=state["tag"])
    for stage in others:
        assert inspect(engines, images[stage])["Id"] == before[stage], stage
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, check=True)  # clean again: the pushed tag


def test_clean_remote_deletes_one_dataset_and_refuses_the_rest(repo, engines, data):
    shutil.copytree(data / "synth/s1", data / "synth/bad")
    for path in [data / "synth/bad", *(data / "synth/bad").rglob("*")]:
        os.chown(path, EYAS_UID, EYAS_UID)  # as if the synth image had written it
    outside = data.parent / "outside.txt"
    outside.write_text("keep me")
    (data / "synth/escape").symlink_to("../..")
    (data / "synth/root").symlink_to("/")
    host = {"HOST": engines.ssh_host, "DATA": str(data)}

    r = make(repo, engines, "clean-remote", DATASET="synth/bad", **host)
    assert "would delete /data/synth/bad" in r.stdout and (data / "synth/bad/manifest.json").exists()
    make(repo, engines, "clean-remote", DATASET="synth/bad", YES="1", **host)
    assert not (data / "synth/bad").exists() and (data / "synth/s1/manifest.json").exists()

    for bad, says in [("..", "not a KIND/NAME inside the data root"), ("synth/../../x", "not a KIND/NAME"),
                      ("/etc/passwd", "is an absolute path"), ("", "set DATASET=KIND/NAME")]:
        r = make(repo, engines, "clean-remote", DATASET=bad, YES="1", check=False, **host)
        assert r.returncode == 2 and says in r.stderr, (bad, r.stderr)
    # a symlink leaving the root: eyas-data refuses it, or (where it treats a link as an alias) deletes
    # the link alone; either way nothing it points to is touched
    for link in ("synth/escape", "synth/root"):
        r = make(repo, engines, "clean-remote", DATASET=link, YES="1", check=False, **host)
        refused = r.returncode != 0 and "refusing to delete" in r.stderr
        unlinked = r.returncode == 0 and "deleted the link" in r.stdout and not (data / link).is_symlink()
        assert refused or unlinked, (link, r.stdout + r.stderr)
    assert outside.read_text() == "keep me" and (data / "synth/s1/manifest.json").exists()
    assert (data / "hidden/h1/manifest.json").exists() and (data / "drafts/d1/manifest.json").exists()
