"""KV lists as page-table rows: which page holds each page-sized chunk of a list.

FA3 reads token j of batch entry b from page `page_table[b, j // page_size]` at offset
`j % page_size`, for `j < cache_seqlens[b]`. A list is either a request's row,
`req_to_token[row, :length]`, or one branch's KV list of a topk>1 draft decode
(`plugserve.attention.draft_kv`): its row of the table is the prefix's pages followed by the
branch's own pages, i.e. the request's page table expanded per branch.

Chunk c of a list (entries `c*page .. (c+1)*page - 1`) is named by the page of its *last*
entry. Rows are page-consistent (position p sits at offset p % page), so any entry names the
same page; a branch list of the holey layout (DESIGN.md §5) may begin its branch chunk with
the prefix's original tail slots before the branch's own slots, and the branch's own page
holds a copy of that tail, so the chunk's last entry names the page that has all of it.

`distinct_page_entries` is the old way (fix toggle `fa3_draft_page_scatter_oob`): one
column per *distinct* page the list touches, which counts the original tail page and the
branch's own first page both, one column more than the row has.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch


def indptr_from_lengths(lengths: list[int]) -> list[int]:
    """[3, 1, 2] -> [0, 3, 4, 6]."""
    return [0, *accumulate(lengths)]


def pages_for(length: int, page_size: int) -> int:
    return -(-length // page_size)


@dataclass
class PageEntries:
    """Where each page id goes: row `owner[e]`, column `column[e]` of a page table whose
    step-tight `width` is the most pages any row needs for its `kv_lens_cpu` tokens."""

    kv_lens_cpu: list[int]
    owner: torch.Tensor  # int64 [entries]
    column: torch.Tensor  # int64 [entries]
    page_ids: torch.Tensor  # int64 [entries]
    width: int


def _chunk_ends(
    lengths_cpu: list[int], page_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every chunk of every list: (owning list, chunk index, index of its last entry)."""
    if any(n < 0 for n in lengths_cpu):
        raise ValueError(f"KV lengths must be >= 0: {lengths_cpu}")
    counts = [pages_for(n, page_size) for n in lengths_cpu]
    total = sum(counts)
    lens = torch.tensor(lengths_cpu, dtype=torch.int64).to(device)
    owner = torch.repeat_interleave(
        torch.arange(len(counts), device=device),
        torch.tensor(counts, dtype=torch.int64).to(device), output_size=total,
    )
    starts = torch.tensor(indptr_from_lengths(counts)[:-1], dtype=torch.int64).to(device)
    chunk = torch.arange(total, device=device) - starts[owner]
    last_entry = torch.minimum((chunk + 1) * page_size, lens[owner]) - 1
    return owner, chunk, last_entry


def _width(lengths_cpu: list[int], page_size: int) -> int:
    return max((pages_for(n, page_size) for n in lengths_cpu), default=0)


def row_page_entries(
    req_to_token: torch.Tensor, rows: torch.Tensor, lengths_cpu: list[int], page_size: int
) -> PageEntries:
    """Pages of `req_to_token[rows[i], :lengths_cpu[i]]` (a length may be 0)."""
    device = req_to_token.device
    owner, chunk, last_entry = _chunk_ends(lengths_cpu, page_size, device)
    slots = req_to_token[rows.to(device)[owner], last_entry].to(torch.int64)
    return PageEntries(list(lengths_cpu), owner, chunk, slots // page_size,
                       _width(lengths_cpu, page_size))


def _list_lengths(kv_indptr_cpu: list[int]) -> list[int]:
    lengths = [b - a for a, b in pairwise(kv_indptr_cpu)]
    if any(n < 1 for n in lengths):
        raise ValueError(f"every KV list needs at least one token; lengths: {lengths}")
    return lengths


def list_page_entries(
    kv_indptr_cpu: list[int], kv_indices: torch.Tensor, page_size: int
) -> PageEntries:
    """Pages of the slot lists `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, one per chunk."""
    device = kv_indices.device
    lengths = _list_lengths(kv_indptr_cpu)
    owner, chunk, last_entry = _chunk_ends(lengths, page_size, device)
    list_starts = torch.tensor(kv_indptr_cpu[:-1], dtype=torch.int64).to(device)
    slots = kv_indices.to(torch.int64)[list_starts[owner] + last_entry]
    return PageEntries(lengths, owner, chunk, slots // page_size, _width(lengths, page_size))


def distinct_page_entries(
    kv_indptr_cpu: list[int], kv_indices: torch.Tensor, page_size: int
) -> PageEntries:
    """The reverted fill: one column per run of equal page ids along each list."""
    device = kv_indices.device
    lengths = _list_lengths(kv_indptr_cpu)
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
    return PageEntries(lengths, owner[new_run], column[new_run], pages[new_run],
                       _width(lengths, page_size))
