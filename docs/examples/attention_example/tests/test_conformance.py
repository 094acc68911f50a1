"""The plugserve conformance suite against this backend: one import, one fixture.

Run it with `pytest tests/` once the package is installed (`pip install -e .`), or without
this file as `plugserve conformance --attention example`.
"""

from __future__ import annotations

import pytest

from plugserve.testing.conformance.suite import *  # noqa: F403


@pytest.fixture
def attention_backend() -> str:
    return "example"
