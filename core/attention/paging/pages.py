"""Page lists of KV lists: offsets, pages per list, the page holding each page-sized chunk.

Chunk c of a list (entries `c*page .. (c+1)*page - 1`) is named by the page of its *last*
entry. Rows are page-consistent (position p sits at offset p % page of its page), so any
entry of a chunk names the same page. A branch list of the holey layout (DESIGN.md §5) may
start its branch chunk with the prefix's original tail slots followed by the branch's own;
the branch's own page holds a copy of that tail in its first slots, so the chunk's last entry
names the page that has the whole chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch


def indptr_from_lengths(lengths: list[int]) -> list[int]:
    """[3, 1, 2] -> [0, 3, 4, 6]."""
    return [0, *accumulate(lengths)]


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages `num_tokens` tokens cover (0 for none)."""
    return -(-num_tokens // page_size)


def _host_int64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


@dataclass
class PageLists:
    """Per-list pages, list after list in chunk order: entry e is chunk `column[e]` of list
    `owner[e]`, held by page `page_ids[e]` (int64 device tensors)."""

    kv_lens_cpu: list[int]  # tokens per list
    page_counts_cpu: list[int]  # pages per list
    owner: torch.Tensor
    column: torch.Tensor
    page_ids: torch.Tensor
    page_size: int

    @property
    def page_indptr_cpu(self) -> list[int]:
        """List i's pages are entries `page_indptr[i]:page_indptr[i+1]`."""
        return indptr_from_lengths(self.page_counts_cpu)

    @property
    def last_page_lens_cpu(self) -> list[int]:
        """Tokens on each list's last page: 1..page_size (0 for an empty list)."""
        return [n - (c - 1) * self.page_size if c else 0
                for n, c in zip(self.kv_lens_cpu, self.page_counts_cpu, strict=True)]

    @property
    def width(self) -> int:
        """The most pages any list needs: a step-tight page-table width."""
        return max(self.page_counts_cpu, default=0)


def _chunk_ends(
    lengths_cpu: list[int], page_size: int, device: torch.device
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every chunk of every list: (page counts, owning list, chunk index, last entry)."""
    if any(n < 0 for n in lengths_cpu):
        raise ValueError(f"KV lengths must be >= 0: {lengths_cpu}")
    counts = [pages_for(n, page_size) for n in lengths_cpu]
    total = sum(counts)
    owner = torch.repeat_interleave(
        torch.arange(len(counts), device=device), _host_int64(counts, device), output_size=total)
    starts = _host_int64(indptr_from_lengths(counts)[:-1], device)
    chunk = torch.arange(total, device=device) - starts[owner]
    last_entry = torch.minimum((chunk + 1) * page_size, _host_int64(lengths_cpu, device)[owner]) - 1
    return counts, owner, chunk, last_entry


def row_page_lists(
    req_to_token: torch.Tensor, rows: torch.Tensor, lengths_cpu: list[int], page_size: int
) -> PageLists:
    """Pages of `req_to_token[rows[i], :lengths_cpu[i]]` for every i (a length may be 0)."""
    device = req_to_token.device
    counts, owner, chunk, last_entry = _chunk_ends(lengths_cpu, page_size, device)
    slots = req_to_token[rows.to(device)[owner], last_entry].to(torch.int64)
    return PageLists(list(lengths_cpu), counts, owner, chunk, slots // page_size, page_size)


def kv_list_lengths(kv_indptr_cpu: list[int]) -> list[int]:
    """Each KV list's length; every list needs one token at least (its query's own)."""
    lengths = [b - a for a, b in pairwise(kv_indptr_cpu)]
    if any(n < 1 for n in lengths):
        raise ValueError(f"every KV list needs at least one token; lengths: {lengths}")
    return lengths


def kv_list_page_lists(
    kv_indptr_cpu: list[int], kv_indices: torch.Tensor, page_size: int
) -> PageLists:
    """Pages of the slot lists `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, one per chunk."""
    device = kv_indices.device
    lengths = kv_list_lengths(kv_indptr_cpu)
    counts, owner, chunk, last_entry = _chunk_ends(lengths, page_size, device)
    list_starts = _host_int64(kv_indptr_cpu[:-1], device)
    slots = kv_indices.to(torch.int64)[list_starts[owner] + last_entry]
    return PageLists(lengths, counts, owner, chunk, slots // page_size, page_size)


def gather_row_slots(
    req_to_token: torch.Tensor, rows: torch.Tensor, lengths_cpu: list[int]
) -> torch.Tensor:
    """Concatenate `req_to_token[rows[i], :lengths_cpu[i]]` over i (int64), without a sync."""
    device = req_to_token.device
    total = sum(lengths_cpu)
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(torch.arange(len(lengths_cpu), device=device),
                                    _host_int64(lengths_cpu, device), output_size=total)
    position = (torch.arange(total, device=device)
                - _host_int64(indptr_from_lengths(lengths_cpu)[:-1], device)[owner])
    return req_to_token[rows.to(device)[owner], position].to(torch.int64)
