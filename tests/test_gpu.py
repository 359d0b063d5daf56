"""The GPU paths against the CPU ones on the same data: extraction on a CUDA device (bf16; flash-attn where it is
installed) gives the hidden states of the CPU fp32 run, and training on the GPU (EAGLE-3 and DFlash) reaches the
CPU run's accuracy.
Marked `gpu`: skipped without a CUDA device (bench/gpu.sh runs them on a lent GPU). On CPU, asking for flash-attn
falls back in one line instead of failing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas_common.contract import Dataset
from eyas_common.hidden import open_hidden
from eyas_testing.datasets import make_synth

MODULES = {"eyas-extract": "eyas_extract.cli", "eyas-train": "eyas_train.cli"}
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (bench/gpu.sh runs these on a lent GPU)")
TRAIN = ["--epochs", "2", "--draft-vocab", "256", "--ttt-steps", "2", "--batch-size", "4", "--log-every", "1"]


def stage(root: Path, *args: str, cpu_only: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "EYAS_DATA": str(root), **({"CUDA_VISIBLE_DEVICES": ""} if cpu_only else {})}
    # by module, not console script: bench/gpu.sh's venv has the packages on PYTHONPATH, not installed
    return subprocess.run([sys.executable, "-m", MODULES[args[0]], *args[1:]], env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def root(tmp_path_factory, fixture_target) -> Path:
    root = tmp_path_factory.mktemp("gpu")
    make_synth(root, fixture_target, n=12, max_new_tokens=40)
    return root


def extract(root: Path, target: Path, name: str, *options: str, cpu_only: bool = False) -> Dataset:
    r = stage(root, "eyas-extract", "run", "--synth", "synth/fx", "--model", str(target), "--name", name, *options,
              cpu_only=cpu_only)
    assert r.returncode == 0, r.stderr[-3000:]
    return Dataset.parse(name, "hidden", root)


def test_flash_attn_asked_for_on_cpu_falls_back_in_one_line(root, fixture_target):
    if CUDA:
        pytest.skip("the fallback is the CPU path")
    r = stage(root, "eyas-extract", "run", "--synth", "synth/fx", "--model", str(fixture_target), "--name", "fa",
              "--attn", "flash_attention_2", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "attention flash_attention_2 unavailable" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@needs_cuda
def test_extraction_on_the_gpu_matches_the_cpu(root, fixture_target):
    cpu = open_hidden(extract(root, fixture_target, "h_cpu", "--device", "cpu", "--dtype", "fp32").ref, root)
    gpu = open_hidden(extract(root, fixture_target, "h_gpu", "--device", "cuda", "--dtype", "bf16").ref, root)
    assert cpu.sample_ids == gpu.sample_ids
    for j in range(len(cpu)):
        a, b = cpu.aux(j), gpu.aux(j)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.min() > 0.99, (j, cos.min())  # bf16 compute over fp32: close, not equal


@pytest.mark.gpu
@needs_cuda
def test_training_on_the_gpu_reaches_the_cpu_accuracy(root, fixture_target):
    hidden = extract(root, fixture_target, "h_train", "--device", "cpu", "--dtype", "fp32")
    for name, cpu_only in (("d_cpu", True), ("d_gpu", False)):
        r = stage(root, "eyas-train", "run", "--hidden", hidden.ref, "--model", str(fixture_target), "--name", name,
                  *TRAIN, cpu_only=cpu_only)
        assert r.returncode == 0, r.stderr[-3000:]
    final = {n: Dataset.parse(n, "drafts", root).read_manifest()["stats"]["final"] for n in ("d_cpu", "d_gpu")}
    assert final["d_gpu"]["step_acc"] == pytest.approx(final["d_cpu"]["step_acc"], abs=0.05), final


@pytest.mark.gpu
@needs_cuda
def test_dflash_on_the_gpu_matches_the_cpu(root, fixture_target):
    """DFlash's five layers extracted on the GPU (fp8, top-k) and a DFlash draft trained there: the same
    states as the CPU's, and the CPU run's per-slot accuracy."""
    layout = ("--method", "dflash", "--teacher", "topk", "--topk", "4", "--aux-dtype", "fp8")
    cpu = open_hidden(extract(root, fixture_target, "h5_cpu", *layout, "--device", "cpu").ref, root)
    gpu = open_hidden(extract(root, fixture_target, "h5_gpu", *layout, "--device", "cuda", "--dtype", "bf16").ref, root)
    for j in range(len(cpu)):
        cos = torch.nn.functional.cosine_similarity(cpu.aux(j).float(), gpu.aux(j).float(), dim=-1)
        assert cos.min() > 0.97, (j, cos.min())  # fp8 storage of bf16 compute against fp8 of fp32
    for name, cpu_only in (("f_cpu", True), ("f_gpu", False)):
        r = stage(root, "eyas-train", "run", "--hidden", "hidden/h5_cpu", "--model", str(fixture_target),
                  "--name", name, "--method", "dflash", "--anchors", "16", "--epochs", "2", "--batch-size", "4",
                  "--log-every", "1", cpu_only=cpu_only)
        assert r.returncode == 0, r.stderr[-3000:]
    final = {n: Dataset.parse(n, "drafts", root).read_manifest()["stats"]["final"] for n in ("f_cpu", "f_gpu")}
    assert final["f_gpu"]["step_acc"] == pytest.approx(final["f_cpu"]["step_acc"], abs=0.05), final
