"""A well-formed test plugin: an attention backend, a cache policy, a speculative algorithm
and a fix toggle.

`dummy_attention` is the reference backend under another name. It supports topk>1 (at
page_size 1) but is not on the core's whitelist, so page_size>1 with topk>1 is refused.
"""

from __future__ import annotations

from typing import Any

from plugserve.attention.base import BackendCapabilities
from plugserve.hookspecs import hookimpl
from plugserve.registry import (
    CachePolicyCapabilities,
    RegisterAttentionBackend,
    RegisterCachePolicy,
    RegisterFixToggle,
    RegisterSpecAlgorithm,
    SpecCapabilities,
)

CAPABILITIES = BackendCapabilities(devices=frozenset({"cpu"}), page_sizes=None, custom_mask=True,
                                   topk_gt1=True)


def _attention() -> Any:
    from plugserve.attention.torch_native import TorchNativeBackend

    class DummyAttentionBackend(TorchNativeBackend):
        name = "dummy_attention"

    return DummyAttentionBackend


def _cache() -> Any:
    from plugserve.cache.no_cache import NoCache

    class DummyCache(NoCache):
        pass

    return DummyCache


@hookimpl
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    register("dummy_attention", _attention, CAPABILITIES, description="torch_native, renamed")


@hookimpl
def plugserve_register_cache_policies(register: RegisterCachePolicy) -> None:
    register(
        "dummy_cache",
        _cache,
        CachePolicyCapabilities(prefix_sharing=False),
        description="no prefix cache, renamed",
    )


@hookimpl
def plugserve_register_fix_toggles(register: RegisterFixToggle) -> None:
    register("dummy_toggle", "a toggle registered by the good test plugin")


@hookimpl
def plugserve_register_spec_algorithms(register: RegisterSpecAlgorithm) -> None:
    # Registered only so tests can ask for topk>1 drafting; it has no implementation.
    register("dummy_spec", lambda: None, SpecCapabilities(topk_gt1=True, overlap=False))
