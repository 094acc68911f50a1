"""Page allocator for one KV pool: hands out and takes back whole pages of slots.

Slot `s` lives in page `s // page_size`. Page 0 is the padding page and is never handed out.
Freeing takes the *pages* of the given slots: callers must only free a page once, which is
why over-allocation is freed from a page boundary (DESIGN.md §4).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ceil_align(value: int, page_size: int) -> int:
    return -(-value // page_size) * page_size


def floor_align(value: int, page_size: int) -> int:
    return value // page_size * page_size


class PagedAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages: list[int] = list(range(num_pages, 0, -1))  # pop() gives low pages first
        self.on_free: list[object] = []  # test doubles may watch frees
        self.peak_used_pages = 0  # most pages ever handed out at once (benchmarks, tests)

    @property
    def total_slots(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        """Free slots (whole free pages times page size)."""
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        if num_pages > len(self.free_pages):
            return None
        if num_pages == 0:
            return []
        taken = self.free_pages[-num_pages:]
        del self.free_pages[-num_pages:]
        taken.reverse()
        self.peak_used_pages = max(self.peak_used_pages, self.num_pages - len(self.free_pages))
        return taken

    def extend_slots(self, last_slot: int, old_len: int, new_len: int) -> list[int] | None:
        """Slots for positions [old_len, new_len) of a row whose position old_len-1 is at
        `last_slot`. Positions left in the row's last partial page come first; whole new
        pages follow. None (and nothing taken) when the pool is short of pages."""
        page = self.page_size
        slots: list[int] = []
        pos = old_len
        if old_len % page and new_len > old_len:
            in_page = min(new_len, ceil_align(old_len, page)) - old_len
            slots.extend(range(last_slot + 1, last_slot + 1 + in_page))
            pos += in_page
        need_pages = -(-(new_len - pos) // page)
        pages = self.alloc_pages(need_pages)
        if pages is None:
            return None
        for p in pages:
            slots.extend(range(p * page, p * page + page))
        return slots[: new_len - old_len]

    def pages_needed(self, old_len: int, new_len: int) -> int:
        page = self.page_size
        return ceil_align(new_len, page) // page - ceil_align(old_len, page) // page

    def free_slots(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Return the pages holding `slots` to the free list (each page once per call)."""
        if isinstance(slots, torch.Tensor):
            if slots.numel() == 0:
                return
            pages = torch.unique(slots // self.page_size).tolist()
        else:
            if not slots:
                return
            pages = sorted({s // self.page_size for s in slots})
        self.free_pages.extend(pages)

    def free_page_set(self) -> set[int]:
        return set(self.free_pages)
