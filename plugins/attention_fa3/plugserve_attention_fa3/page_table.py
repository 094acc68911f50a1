"""The persistent page-table buffer: rows of page ids scattered into one flat int32 buffer.

Sized once, like a CUDA-graph buffer, for `max_batch_size * topk` rows (a topk>1 draft decode
has one row per branch) of up to a request row's pages. Each batch uses a step-tight
`[rows, width]` view at its start, `width` being the most pages any of its rows needs. The
scatter writes entry (row, column) at flat index `row * width + column` without a bounds check
of its own, as a kernel would: a column past `width` lands in the next row (or in the unused
tail of the buffer). The fixed fill never produces one; fix toggle `fa3_draft_page_scatter_oob`
shows what happens when it does.
"""

from __future__ import annotations

import torch

from plugserve.attention.paging import PageLists, pages_for


class PageTableOverflow(RuntimeError):
    """A batch's page table is larger than the persistent buffer."""


class PageTableBuffer:
    def __init__(self, *, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.pages_per_row = 0
        self.flat = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.generation = 0  # counts batches written; metadata remembers its own

    def fit_rows(self, row_width: int, page_size: int) -> None:
        """Size for rows as long as a request row (`row_width` positions); grows only."""
        pages = pages_for(row_width, page_size)
        if pages > self.pages_per_row:
            self.pages_per_row = pages
            self.flat = torch.zeros(self.max_rows * pages, dtype=torch.int32,
                                    device=self.device)

    def table(self, entries: PageLists) -> torch.Tensor:
        """Scatter `entries` into the buffer; returns the int32 `[rows, width]` view."""
        rows = len(entries.kv_lens_cpu)
        width = max(entries.width, 1)
        if rows * width > self.flat.numel():
            raise PageTableOverflow(
                f"page table of {rows} rows x {width} pages does not fit the buffer of "
                f"{self.max_rows} rows x {self.pages_per_row} pages"
            )
        flat_index = entries.owner * width + entries.column
        self.flat.index_put_((flat_index,), entries.page_ids.to(torch.int32))
        self.generation += 1
        return self.flat[: rows * width].view(rows, width)
