"""Fixtures of the FA3 backend's tests.

CPU tests run the backend with `plugserve_attention_fa3.reference` in place of FA3 (the same
`flash_attn_with_kvcache` calls, interpreted in torch). `gpu`-marked tests run the real
kernels and are skipped without CUDA or without an FA3 build.
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


def _fa3_installed() -> bool:
    if importlib.util.find_spec("flash_attn_interface") is not None:
        return True
    try:
        return importlib.util.find_spec("sgl_kernel.flash_attn") is not None
    except ModuleNotFoundError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and _fa3_installed():
        return
    skip = pytest.mark.skip(reason="needs CUDA and an FA3 build (flash_attn_interface or "
                            "sgl_kernel.flash_attn; the [cuda] extra)")
    for item in items:
        if "gpu" in item.keywords and "attention_fa3" in str(item.path):
            item.add_marker(skip)


@pytest.fixture
def cases(request: pytest.FixtureRequest) -> Cases:
    """Seeded per test, on the CPU."""
    return Cases(torch.device("cpu"), sum(map(ord, request.node.name)) % 10_000)


@pytest.fixture
def gpu_cases(request: pytest.FixtureRequest) -> Cases:
    return Cases(torch.device("cuda"), sum(map(ord, request.node.name)) % 10_000)
