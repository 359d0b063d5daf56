"""Image tests run only under `make test-images` (root, apt, a docker engine): skipped in `make test`."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("EYAS_IMAGE_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="builds and runs docker images as root: run `make test-images`")
    for item in items:
        if "tests/images/" in str(item.path):
            item.add_marker(skip)
