"""The conformance suite against the backend named by --attention-backend: torch_native,
the built-in reference, unless told otherwise (`pytest tests/conformance/test_torch_native.py
--attention-backend triton` runs the same matrix on Triton)."""

from __future__ import annotations

import pytest

from plugserve.testing.conformance.suite import *  # noqa: F403

pytestmark = pytest.mark.integration  # the suite's speculative cases run the eagle plugin
