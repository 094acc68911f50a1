"""The cache-policy suite passes on every shipped policy: radix, swa_radix,
streaming_session and none (what each does not declare is skipped with the reason)."""

from __future__ import annotations

import pytest

from plugserve.testing.conformance.cache.suite import *  # noqa: F403

SHIPPED = ["radix", "swa_radix", "streaming_session", "none"]


@pytest.fixture(params=SHIPPED)
def cache_policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)
