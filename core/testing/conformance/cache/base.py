"""The base of every cache-suite class: pick the policy under test, gate each test on what it
requires, mark the policy's known failures."""

from __future__ import annotations

import pytest

from plugserve.testing.conformance.cache.target import CachePolicyUnderTest, CacheRequirements
from plugserve.testing.conformance.declared import gate
from plugserve.testing.conformance.threads import OneCPUThread


class CacheConformanceTest(OneCPUThread):
    """Suite tests get `self.target` (the `CachePolicyUnderTest`). A test needing a declared
    capability says so with `@requires(...)`; when the policy does not declare it the test is
    skipped with the reason. The `cache_target` and `cache_requirements` fixtures come from
    plugserve's pytest plugin (`--cache-policy NAME`, or a `cache_policy` fixture of the test
    module)."""

    target: CachePolicyUnderTest

    @pytest.fixture(autouse=True)
    def _cache_gate(self, request: pytest.FixtureRequest, cache_target: CachePolicyUnderTest,
                    cache_requirements: CacheRequirements) -> None:
        gate(request, type(self), cache_requirements)
        self.target = cache_target
