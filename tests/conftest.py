"""Shared test fixtures: the tiny thinking target (built once, cached) and a real vLLM server on it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from eyas_testing.fixture import build_fixture
from eyas_testing.servers import VllmServer, default_vllm_python, running_vllm


# --- markers (registered in pytest.ini, which makes an unregistered one an error) ---------------------------
# `make test-fast` runs `-m "not slow"`. Marked slow here: every `vllm` test, and every test that uses a session
# fixture that starts vLLM or trains a draft; tests/images (skipped outside `make test-images`) too. Tests that
# train or extract across processes, or build a fixture of their own, carry `@pytest.mark.slow` themselves.
SLOW_FIXTURES = frozenset({"vllm_server", "trained_draft"})
IMAGE_TESTS = Path(__file__).parent / "images"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("vllm") or uses & SLOW_FIXTURES or IMAGE_TESTS in item.path.parents:
            item.add_marker(pytest.mark.slow)
# --- end markers ------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    # A suite started in the background (`make test &`, nohup) inherits SIGINT ignored, and so would every
    # process it starts: the Ctrl-C tests would then interrupt nothing (a bench ran on and exited 0 once the
    # server it measured had stopped). A handler, unlike "ignored", does not survive exec, so with Python's
    # own one here the children start with SIGINT at its default again.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Fail, not skip: CI installs vLLM, so a missing one is a broken setup, not an optional extra.
    if item.get_closest_marker("vllm") and not default_vllm_python().exists():
        pytest.fail(f"vLLM tests need {default_vllm_python()}: run `make vllm` first", pytrace=False)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def fixture_target() -> Path:
    return build_fixture()


@pytest.fixture(scope="session")
def vllm_server(fixture_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # Start-up takes one to two minutes on a 2-core CPU, more when the machine is busy.
    with running_vllm(
        fixture_target, log_path=log, timeout_s=600, extra_args=["--reasoning-parser", "kimi_k2"]
    ) as server:
        yield server


# The default recipe (resolved from the data: stages/03_train/README.md); only the output is quieter.
RECIPE = dict(log_every=100, ckpt_every=500)


@dataclass(frozen=True)
class TrainedDraft:
    root: Path      # the data root holding synth/, hidden/ and drafts/fixture_trained
    ref: str        # drafts/fixture_trained
    path: Path
    train_s: float  # wall time of the training run


@pytest.fixture(scope="session")
def trained_draft(fixture_target: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainedDraft:
    """A draft trained once per session on 400 of the fixture's own answers (several minutes of CPU):
    stage 03 checks its training, stage 04 serves and benchmarks it."""
    from eyas_train.train import run as train
    from eyas_testing.datasets import build_datasets

    root = tmp_path_factory.mktemp("trained_draft")
    hidden = build_datasets(root, fixture_target, 400, seed=0)
    t0 = time.monotonic()
    path = train(hidden=hidden.ref, model=fixture_target, name="fixture_trained", data_root=root, **RECIPE)
    return TrainedDraft(root, "drafts/fixture_trained", path, time.monotonic() - t0)
