"""Persistent page-index buffers, sized once like CUDA-graph buffers and reused every batch.

A topk>1 draft decode gives every branch its own page list (prefix pages + the branch's own
pages), so the buffer must hold `max_batch_size * topk` lists of up to a row's worth of pages
each. Writing more page ids than the buffer holds stops with `IndexBufferOverflow`, the
always-on check that turns a too-small buffer into a clear error instead of a kernel writing
past it.

The buffer is shared by every batch, so a batch's page ids are valid until the next batch
writes its own: `generation` counts the writes, and metadata remembers the one it got.
"""

from __future__ import annotations

import torch

from plugserve.attention.paging import pages_for


class IndexBufferOverflow(RuntimeError):
    """A batch needs more page ids than the persistent kv_indices buffer holds."""


class PageIndexBuffer:
    """int32 kv_indices storage for `max_lists` lists of at most a row's pages each."""

    def __init__(self, *, max_lists: int, device: torch.device, sizing: str) -> None:
        self.max_lists = max_lists
        self.device = torch.device(device)
        self.sizing = sizing  # how max_lists was computed, for the overflow message
        self.pages_per_list = 0
        self.indices = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.generation = 0

    @property
    def capacity(self) -> int:
        return int(self.indices.numel())

    def fit_rows(self, row_width: int, page_size: int) -> None:
        """Size for lists as long as a request row (`row_width` positions); grows only."""
        pages = pages_for(row_width, page_size)
        if pages > self.pages_per_list:
            self.pages_per_list = pages
            self.indices = torch.zeros(self.max_lists * pages, dtype=torch.int32,
                                       device=self.device)

    def write(self, page_ids: torch.Tensor, num_lists: int) -> torch.Tensor:
        """Copy `page_ids` into the buffer; returns the int32 view holding them."""
        needed = int(page_ids.numel())
        if needed > self.capacity:
            raise IndexBufferOverflow(
                f"kv_indices needs {needed} page ids for {num_lists} KV lists but its buffer "
                f"holds {self.capacity} ({self.sizing} = {self.max_lists} lists x "
                f"{self.pages_per_list} pages per row)"
            )
        view = self.indices[:needed]
        view.copy_(page_ids.to(torch.int32), non_blocking=True)
        self.generation += 1
        return view
