"""The plugserve conformance suite against the Triton backend: the smoke subset (a few
representative kernel cases and one engine run), since the CPU interpreter is slow. The full
suite: `plugserve conformance --attention triton` (or `pytest tests/conformance/
test_torch_native.py --attention-backend triton` in a plugserve checkout)."""

from __future__ import annotations

import pytest
import torch

from plugserve.testing.conformance.smoke import *  # noqa: F403


@pytest.fixture
def attention_backend() -> str:
    return "triton"


@pytest.fixture
def conformance_device(kernel_device: torch.device) -> str:
    """cuda with compiled kernels, else cpu (the interpreter)."""
    return kernel_device.type
