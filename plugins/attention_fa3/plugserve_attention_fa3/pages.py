"""The reverted branch fill of fix toggle `fa3_draft_page_scatter_oob` (SGLang PR 27360).

The fixed fill is `plugserve.attention.paging.kv_list_page_lists`: one page-table column per
page-sized chunk of a KV list, named by the chunk's last entry. The old fill gave each list
one column per *distinct* page it touches, which counts both the prefix's original tail page
and the branch's own first page (that holds the tail's copy): one column more than the
step-tight row has, so the scatter writes past the row and branches read the wrong KV.
"""

from __future__ import annotations

import torch

from plugserve.attention.paging import (
    PageLists,
    indptr_from_lengths,
    kv_list_lengths,
    pages_for,
)


def distinct_page_lists(
    kv_indptr_cpu: list[int], kv_indices: torch.Tensor, page_size: int
) -> PageLists:
    """The reverted fill: one column per run of equal page ids along each list; the width
    stays the step-tight one (pages for the list's length)."""
    device = kv_indices.device
    lengths = kv_list_lengths(kv_indptr_cpu)
    pages = kv_indices.to(torch.int64) // page_size
    owner = torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        torch.tensor(lengths, dtype=torch.int64).to(device), output_size=int(pages.numel()),
    )
    new_run = torch.ones_like(pages, dtype=torch.bool)
    new_run[1:] = (pages[1:] != pages[:-1]) | (owner[1:] != owner[:-1])
    run_index = torch.cumsum(new_run.to(torch.int64), 0) - 1
    first_run = torch.tensor(indptr_from_lengths(lengths)[:-1], dtype=torch.int64).to(device)
    column = run_index - run_index[first_run][owner]
    return PageLists(lengths, [pages_for(n, page_size) for n in lengths], owner[new_run],
                     column[new_run], pages[new_run], page_size)
