"""Built-in plugin: the reference attention backend, the core cache policies, the Hermes
tool-call parser and the core's fix toggles.

Registered through exactly the same hooks as external plugins; it is essential and cannot be
disabled.
"""

from __future__ import annotations

from typing import Any

from plugserve.attention.capabilities import TORCH_NATIVE_CAPABILITIES
from plugserve.hookspecs import hookimpl
from plugserve.registry import (
    CachePolicyCapabilities,
    RegisterAttentionBackend,
    RegisterCachePolicy,
    RegisterFixToggle,
    RegisterSpecAlgorithm,
    RegisterToolParser,
    SpecCapabilities,
)


def _torch_native() -> Any:
    from plugserve.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend


def _radix() -> Any:
    from plugserve.cache.radix import RadixCache

    return RadixCache


def _swa_radix() -> Any:
    from plugserve.cache.swa_radix import SWARadixCache

    return SWARadixCache


def _streaming_session() -> Any:
    from plugserve.cache.swa_radix import SWARadixCache  # exactly radix without a SWA pool

    return SWARadixCache


def _no_cache() -> Any:
    from plugserve.cache.no_cache import NoCache

    return NoCache


def _no_spec() -> Any:
    return None


def _hermes() -> Any:
    from plugserve.tools.hermes import HermesToolParser

    return HermesToolParser


@hookimpl
def plugserve_register_tool_parsers(register: RegisterToolParser) -> None:
    register("hermes", _hermes,
             description="Hermes / Qwen: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>")


@hookimpl
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    register(
        "torch_native",
        _torch_native,
        TORCH_NATIVE_CAPABILITIES,
        description="reference backend in plain PyTorch; any page size; CPU and CUDA",
    )


@hookimpl
def plugserve_register_cache_policies(register: RegisterCachePolicy) -> None:
    register("radix", _radix, CachePolicyCapabilities(), description="page-aligned radix tree")
    register(
        "swa_radix",
        _swa_radix,
        CachePolicyCapabilities(sliding_window=True),
        description="radix tree for sliding-window models: SWA KV tombstoned on its own, "
        "matches only where the last window is intact",
    )
    register(
        "streaming_session",
        _streaming_session,
        CachePolicyCapabilities(sessions=True, sliding_window=True),
        description="radix, plus streaming sessions that keep a conversation's KV between "
        "turns (a first turn may share a prefix through the tree; later turns bypass it)",
    )
    register(
        "none",
        _no_cache,
        CachePolicyCapabilities(prefix_sharing=False, sliding_window=True),
        description="no prefix cache: every request's KV is freed when it ends",
    )


@hookimpl
def plugserve_register_spec_algorithms(register: RegisterSpecAlgorithm) -> None:
    register(
        "none",
        _no_spec,
        SpecCapabilities(topk_gt1=False),
        description="no speculative decoding",
    )


@hookimpl
def plugserve_register_fix_toggles(register: RegisterFixToggle) -> None:
    # Each toggle is defined next to the rule it reverts.
    from plugserve.cache.swa_radix import SWA_MATCH_ACROSS_TOMBSTONE
    from plugserve.mem.manager import FINISH_OVERALLOC_UNALIGNED, RETRACT_NO_RESET
    from plugserve.mem.session_kv import SESSION_DOUBLE_COUNT, SESSION_RETRACT_TAIL_LEAK
    from plugserve.mem.spec_accounting import SPEC_V2_BONUS_PRECLAIM
    from plugserve.mem.swa_window import SWA_EVICT_PARTIAL_PAGE, SWA_UNCACHED_FROM_PROTECTED
    from plugserve.parallel.cross_check import TP_RANK1_SKIPS_FREE
    from plugserve.sched.scheduler import BATCH_IDENTITY

    for toggle in (
        BATCH_IDENTITY, FINISH_OVERALLOC_UNALIGNED, RETRACT_NO_RESET, SPEC_V2_BONUS_PRECLAIM,
        SESSION_DOUBLE_COUNT, SESSION_RETRACT_TAIL_LEAK, SWA_UNCACHED_FROM_PROTECTED,
        SWA_EVICT_PARTIAL_PAGE, SWA_MATCH_ACROSS_TOMBSTONE, TP_RANK1_SKIPS_FREE,
    ):
        register(toggle, toggle.description)
