"""The speculative-algorithm suite passes on the shipped `eagle` algorithm, on the reference
backend (the Triton backend's combinations run in `plugserve conformance --spec eagle` and in
plugins/spec_eagle/tests/test_spec_triton.py: its CPU interpreter is slow)."""

from __future__ import annotations

import pytest

from plugserve.testing.conformance.spec import engine as spec_suite

pytest.importorskip("plugserve_spec_eagle")
pytestmark = pytest.mark.integration  # the suite on the eagle plugin


class TestEagleFootprint(spec_suite.TestSpecFootprint):
    backends = ("torch_native",)


class TestEagleLossless(spec_suite.TestSpecLossless):
    backends = ("torch_native",)


@pytest.fixture
def spec_algorithm() -> str:
    return "eagle"
