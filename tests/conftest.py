"""Shared test fixtures: the tiny thinking target (built once, cached) and a real vLLM server on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eyas_common.fixture import build_fixture
from eyas_common.servers import VllmServer, default_vllm_python, running_vllm


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: runs a real vLLM server from .venv-vllm (`make vllm` installs it)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Fail, not skip: CI installs vLLM, so a missing one is a broken setup, not an optional extra.
    if item.get_closest_marker("vllm") and not default_vllm_python().exists():
        pytest.fail(f"vLLM tests need {default_vllm_python()}: run `make vllm` first", pytrace=False)


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
