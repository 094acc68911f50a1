"""Fixtures of the FlashInfer backend's tests.

CPU tests run the backend with `plugserve_attention_flashinfer.reference` in place of
flashinfer (the same plan/run calls, interpreted in torch). `gpu`-marked tests run the real
kernels and are skipped without CUDA or without the flashinfer package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
for path in (_HERE.parent, _HERE):  # run from a checkout without installing the plugin
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from plugserve.testing.paged_cases import Cases  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None:
        return
    skip = pytest.mark.skip(reason="needs CUDA and flashinfer-python (the [cuda] extra)")
    for item in items:
        if "gpu" in item.keywords and "attention_flashinfer" in str(item.path):
            item.add_marker(skip)


@pytest.fixture
def cases(request: pytest.FixtureRequest) -> Cases:
    """Seeded per test, on the CPU."""
    return Cases(torch.device("cpu"), sum(map(ord, request.node.name)) % 10_000)


@pytest.fixture
def gpu_cases(request: pytest.FixtureRequest) -> Cases:
    return Cases(torch.device("cuda"), sum(map(ord, request.node.name)) % 10_000)
