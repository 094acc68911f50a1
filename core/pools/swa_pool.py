"""Hybrid sliding-window KV memory: a full pool and a SWA pool joined by a page map
(DESIGN.md §6).

Every request position maps to a *full* slot (the `req_to_token` row, the radix tree, the
speculative KV moves and the draft layout all speak full slots). Full-attention layers keep
their K/V in the full pool's buffers at that slot. Windowed layers keep theirs in the much
smaller SWA pool: full page `p` maps to SWA page `swa_page_map[p]` (0 = none), and full slot
`s` to SWA slot `swa_page_map[s // page] * page + s % page`. Only a windowed layer's KV access
translates; nothing else in the engine knows SWA slots exist.

Page 0 is the padding page of both pools and is never handed out: a position whose SWA page
was freed (it fell out of the window, or the cache tombstoned it) translates into the padding
page, which the window mask hides anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from plugserve.pools.allocator import PagedAllocator, ceil_align
from plugserve.pools.kv_pool import KVPool

if TYPE_CHECKING:
    from plugserve.config import EngineConfig


def swa_pool_pages(
    cfg: EngineConfig, window: int, reserve: int, full_pages: int
) -> tuple[int, list[str]]:
    """Pages of the sliding-window pool, and why the configured size cannot work (empty =
    fine). Default: every running request's window plus one prefill chunk (a prompt without
    chunking is written whole before its window moves), capped by the full pool."""
    page = cfg.page_size
    # One request: its window, a speculative round's reserve, the page the window starts in
    # and the page being written.
    one = ceil_align(window + reserve, page) + 2 * page
    tokens = cfg.swa_pool_tokens
    if tokens is None:
        prefill = ceil_align(cfg.chunked_prefill_size or cfg.max_prefill_tokens, page)
        tokens = min(full_pages * page, cfg.max_running_requests * one + prefill)
    if tokens < one:
        return 1, [
            f"swa_pool_tokens={tokens} cannot hold one request's sliding window: it needs at "
            f"least {one} slots (window {window} + speculative reserve {reserve}, rounded to "
            f"pages of {page}, + 2 pages); raise swa_pool_tokens or leave it unset"
        ]
    return max(1, tokens // page), []


class HybridAllocator(PagedAllocator):
    """The full pool's allocator, with a SWA page mapped to every full page it hands out.

    It keeps `PagedAllocator`'s interface (alloc_pages / extend_slots / free_slots /
    available_size / pages_needed), so the KV manager's code paths do not fork: allocating a
    full page maps a SWA page to it; freeing a full page frees its SWA page when mapped.
    `available_size()` is the *full* pool's (its conservation law); the SWA pool's is
    `self.swa.available_size()`.
    """

    def __init__(self, num_pages: int, swa_num_pages: int, page_size: int,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(num_pages, page_size)
        self.swa = PagedAllocator(swa_num_pages, page_size)
        # full page -> SWA page (0 = none). On the model's device: backends translate with it.
        self.swa_page_map = torch.zeros(num_pages + 1, dtype=torch.int64, device=device)
        self._map_cpu = [0] * (num_pages + 1)  # host mirror: no device sync on the hot path

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        if num_pages > len(self.swa.free_pages):
            return None  # nothing taken: both pools must have the pages
        full = super().alloc_pages(num_pages)
        if full is None or not full:
            return full
        swa = self.swa.alloc_pages(num_pages)
        assert swa is not None
        self._set_map(full, swa)
        return full

    def free_slots(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Free the full pages of `slots` and the SWA pages mapped to them."""
        self.free_swa_of_pages(self._pages(slots))
        super().free_slots(slots)

    def _pages(self, slots: torch.Tensor | Sequence[int]) -> list[int]:
        if isinstance(slots, torch.Tensor):
            if slots.numel() == 0:
                return []
            return torch.unique(slots // self.page_size).tolist()
        return sorted({s // self.page_size for s in slots})

    def free_swa_of_slots(self, slots: torch.Tensor | Sequence[int]) -> int:
        """Free only the SWA pages of the full pages holding `slots` (the full pages stay);
        returns SWA slots freed."""
        return self.free_swa_of_pages(self._pages(slots))

    def free_swa_of_pages(self, full_pages: list[int]) -> int:
        mapped = [p for p in full_pages if self._map_cpu[p]]
        if not mapped:
            return 0
        self.swa.free_pages.extend(self._map_cpu[p] for p in mapped)
        self._set_map(mapped, [0] * len(mapped))
        return len(mapped) * self.page_size

    def mapped_pages(self, full_pages: Sequence[int]) -> int:
        """How many of `full_pages` have a SWA page."""
        return sum(1 for p in full_pages if self._map_cpu[p])

    def swa_page_of(self, full_page: int) -> int:
        return self._map_cpu[full_page]

    def _set_map(self, full: list[int], swa: list[int]) -> None:
        for p, s in zip(full, swa, strict=True):
            self._map_cpu[p] = s
        self.swa_page_map[torch.tensor(full, dtype=torch.int64, device=self.swa_page_map.device)
                          ] = torch.tensor(swa, dtype=torch.int64,
                                           device=self.swa_page_map.device)

    def translate(self, slots: torch.Tensor) -> torch.Tensor:
        """Full slots -> SWA slots (unmapped pages -> the padding page)."""
        page = self.page_size
        if page == 1:
            return self.swa_page_map[slots]
        return self.swa_page_map[slots // page] * page + slots % page


class HybridKVPool(KVPool):
    """The target model's K/V in place of a `KVPool`: full-attention layers in `full`,
    windowed layers in `swa`, both addressed by *full* slots (translated here)."""

    def __init__(self, full: KVPool, swa: KVPool, allocator: HybridAllocator) -> None:
        # No KVPool.__init__: the buffers are the two pools' own.
        self.full = full
        self.swa = swa
        self.allocator = allocator
        self.name = "hybrid"
        self.num_pages = full.num_pages
        self.page_size = full.page_size
        self.dtype = full.dtype
        self.device = full.device
        self.num_kv_heads = full.num_kv_heads
        self.head_dim = full.head_dim
        self.swa_layer_ids = frozenset(swa.layer_ids)
        self.layer_ids = sorted([*full.layer_ids, *swa.layer_ids])
        self.k_buffer = {**full.k_buffer, **swa.k_buffer}
        self.v_buffer = {**full.v_buffer, **swa.v_buffer}

    @property
    def total_slots(self) -> int:
        return self.full.total_slots

    def is_windowed(self, layer_id: int) -> bool:
        return layer_id in self.swa_layer_ids

    def slots_for_layer(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """The slots of layer `layer_id`'s buffer that hold the KV of full slots `slots`. A
        backend that reads a windowed layer's buffer must index it with these."""
        if layer_id in self.swa_layer_ids:
            return self.allocator.translate(slots)
        return slots

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().set_kv(layer_id, self.slots_for_layer(layer_id, loc), k, v)

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the KV of full slots `src` into full slots `dst` in every layer (EAGLE's
        accepted-KV move); windowed layers translate both sides."""
        self.full.copy_slots(dst, src)
        self.swa.copy_slots(self.allocator.translate(dst), self.allocator.translate(src))
