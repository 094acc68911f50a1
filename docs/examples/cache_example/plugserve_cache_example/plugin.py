"""The plugin module the entry point names: registers the "lru_radix" cache policy.

Light on purpose: the policy module is imported by the loader, only when `--cache lru_radix`
is selected.
"""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve.registry import CachePolicyCapabilities

POLICY_NAME = "lru_radix"

# Every capability here is a promise the conformance suite holds the policy to.
CAPABILITIES = CachePolicyCapabilities(
    prefix_sharing=True,  # it stores prefixes and offers them to later requests
    sliding_window=False,  # no SWA side: the engine refuses it for sliding-window models
    sessions=True,  # path_size is exact (inherited), so streaming sessions may lock through it
)


def load_policy() -> Any:
    from plugserve_cache_example.cache import LRURadixCache

    return LRURadixCache


@hookimpl
def plugserve_register_cache_policies(register: Any) -> None:
    register(POLICY_NAME, load_policy, CAPABILITIES,
             description="radix tree with an LRU bound on cached tokens "
             "(PLUGSERVE_LRU_RADIX_MAX_CACHED_TOKENS)")
