"""The docs' worked example cache policy (`lru_radix`) passes the whole cache-policy suite,
and its own tests of the bound, with a bound small enough that the suite's workloads go past
it. It is registered in-process through its plugin module, as `pip install
docs/examples/cache_example` would register it."""

from __future__ import annotations

import pytest
from test_lru_radix_bound import *  # noqa: F403  (the example's own tests of its bound)

from plugserve.testing.conformance.cache.suite import *  # noqa: F403


@pytest.fixture
def cache_policy(cache_plugins: None, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PLUGSERVE_LRU_RADIX_MAX_CACHED_TOKENS", "64")
    return "lru_radix"


def test_registered_through_the_hook(cache_plugins: None) -> None:
    from plugserve_cache_example.cache import LRURadixCache
    from plugserve_cache_example.plugin import CAPABILITIES

    from plugserve.plugins import get_plugin_host

    entry = get_plugin_host().registries.cache.get("lru_radix")
    assert entry.plugin == "lru_radix"
    assert entry.capabilities is CAPABILITIES
    assert entry.load() is LRURadixCache
