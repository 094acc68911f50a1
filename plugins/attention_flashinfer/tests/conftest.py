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

from plugserve.testing.gpu_backend import (  # noqa: E402
    cases,
    gpu_cases,
    skip_gpu_tests_unless,
)

__all__ = ["cases", "gpu_cases"]  # the shared fixtures, for the tests here


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
    skip_gpu_tests_unless(available, items, plugin_dir="attention_flashinfer",
                          reason="needs CUDA and flashinfer-python (the [cuda] extra)")
