"""Building an engine's KV memory: the request rows, the pool(s) with their allocator, the
prefix cache and the KV manager that owns them (sizes from the config, the model and the
speculative footprint).

A model with sliding-window layers gets a separate `swa` pool for them when the attention
backend declares that it translates their slots (`BackendCapabilities.swa_slot_translation`);
otherwise one pool holds every layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from plugserve.attention.capabilities import BackendCapabilities
from plugserve.config import EngineConfig
from plugserve.mem.manager import KVManager
from plugserve.model.arch import ModelArchConfig
from plugserve.pools.allocator import PagedAllocator, ceil_align
from plugserve.pools.kv_pool import KVPool, kv_cache_torch_dtype
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.pools.swa_pool import HybridAllocator, HybridKVPool, swa_pool_pages
from plugserve.structs.spec_footprint import SpecFootprint

DEFAULT_KV_BYTES = 2 << 30  # KV pool budget when kv_pool_tokens is not given
# ... at most this share of what the device's memory leaves once the weights are in it
KV_MEMORY_SHARE = 0.5


def device_memory_bytes(device: torch.device) -> int | None:
    """The device's total memory (physical RAM for the CPU); None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_kv_bytes(device: torch.device, weight_bytes: int) -> int:
    """The default pool's byte budget: DEFAULT_KV_BYTES, or less where the device's memory
    minus the weights' resident bytes (quantized weights as their blocks) is small."""
    total = device_memory_bytes(device)
    if total is None:
        return DEFAULT_KV_BYTES
    left = max(0, total - weight_bytes)
    return min(DEFAULT_KV_BYTES, max(64 << 20, int(left * KV_MEMORY_SHARE)))


class KVSizeError(ValueError):
    """The configured pool sizes cannot work; `reasons` lists every one."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass
class KVMemory:
    kv: KVManager
    kv_pool: KVPool | HybridKVPool
    num_pages: int  # of the full pool
    swa_layer_ids: list[int]


def build_kv_memory(
    cfg: EngineConfig, arch: ModelArchConfig, *, dtype: torch.dtype, device: torch.device,
    context_len: int, attention_caps: BackendCapabilities, cache_entry: Any,
    footprint: SpecFootprint | None, weight_bytes: int = 0,
) -> KVMemory:
    page = cfg.page_size
    # Windowed layers get their own pool when the backend translates their slots.
    swa_layer_ids = (
        arch.sliding_window_layer_ids
        if cfg.swa_pools and attention_caps.swa_slot_translation else []
    )
    # The pools store the KV cache dtype: a narrower one fits more tokens in the same bytes.
    kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, dtype)
    layer_bytes = (2 * arch.num_key_value_heads * arch.head_dim
                   * torch.finfo(kv_dtype).bits // 8)
    bytes_per_token = layer_bytes * max(
        1, arch.num_hidden_layers - len(swa_layer_ids))
    pool_tokens = cfg.kv_pool_tokens or min(
        cfg.max_running_requests * context_len,
        default_kv_bytes(device, weight_bytes) // bytes_per_token,
    )
    num_pages = max(1, pool_tokens // page)
    window = max((w for w in arch.layer_sliding_window if w is not None), default=0)
    swa_pages = 0
    if swa_layer_ids:
        swa_pages, problems = swa_pool_pages(
            cfg, window, footprint.reserve_len if footprint is not None else 0, num_pages)
        if problems:
            raise KVSizeError(problems)  # before any buffer is allocated

    extra = footprint.extra_row_width if footprint is not None else 0
    row_width = ceil_align(context_len + 2 + extra, page) + page
    rows = ReqToTokenPool(cfg.max_running_requests, row_width, device)
    layer_ids = [layer.layer_id for layer in arch.attention_layers()]
    pool_args: dict[str, Any] = dict(
        page_size=page, num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
        dtype=kv_dtype, device=device,
    )
    allocator: PagedAllocator
    if swa_layer_ids:
        allocator = HybridAllocator(num_pages, swa_pages, page, device)
        full_ids = [i for i in layer_ids if i not in swa_layer_ids]
        kv_pool = HybridKVPool(
            KVPool(num_pages=num_pages, layer_ids=full_ids, **pool_args),
            KVPool(num_pages=swa_pages, layer_ids=swa_layer_ids, name="swa",
                   **pool_args),
            allocator,
        )
    else:
        allocator = PagedAllocator(num_pages, page)
        kv_pool = KVPool(num_pages=num_pages, layer_ids=layer_ids, **pool_args)
    cache = cache_entry.load()(rows, allocator, page)
    if window:
        cache.set_sliding_window(window, cfg.revert_fixes)
    kv = KVManager(
        rows=rows, allocator=allocator, cache=cache,
        prefix_sharing=cache_entry.capabilities.prefix_sharing,
        sessions=cache_entry.capabilities.sessions,
        revert_fixes=cfg.revert_fixes,
        sliding_window=window if swa_layer_ids else None,
        spec_reserve_len=footprint.reserve_len if footprint is not None else None,
        overlap=cfg.overlap,
    )
    return KVMemory(kv, kv_pool, num_pages, list(swa_layer_ids))
