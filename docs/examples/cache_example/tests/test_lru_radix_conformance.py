"""The plugserve cache-policy conformance suite against this policy: one import, one fixture.

Run it with `pytest tests/` once the package is installed (`pip install -e .`), or without
this file as `plugserve conformance --cache lru_radix`.
"""

from __future__ import annotations

import pytest

from plugserve.testing.conformance.cache.suite import *  # noqa: F403


@pytest.fixture
def cache_policy(monkeypatch: pytest.MonkeyPatch) -> str:
    # A small bound, so the suite's workloads go past it and the bound's evictions run too.
    monkeypatch.setenv("PLUGSERVE_LRU_RADIX_MAX_CACHED_TOKENS", "64")
    return "lru_radix"
