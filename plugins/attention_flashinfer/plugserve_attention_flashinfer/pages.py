"""KV lists as FlashInfer page lists: which page holds each page-sized chunk of a list.

FlashInfer reads token j of list i from page `kv_indices[kv_indptr[i] + j // page_size]` at
offset `j % page_size`, and the last page holds `kv_last_page_len[i]` tokens (1..page_size).
A list here is either a request's row, `req_to_token[row, :length]`, or one of the per-branch
KV lists of a topk>1 draft decode (`plugserve.attention.draft_kv`).

Chunk c of a list (entries `c*page .. (c+1)*page - 1`) is named by the page of its *last*
entry. Rows are page-consistent (position p sits at offset p % page of its page), so any
entry of a chunk names the same page. A branch list of the holey layout (DESIGN.md §5) may
start its branch chunk with the prefix's original tail slots, followed by the branch's own
slots; the branch's own page holds a copy of that tail in its first slots, so the chunk's
last entry names the page that has the whole chunk.
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
class PageLists:
    """Per-list pages: `page_ids` (int64, device) list after list, in chunk order."""

    kv_lens_cpu: list[int]
    page_counts_cpu: list[int]
    page_ids: torch.Tensor
    page_size: int

    @property
    def page_indptr_cpu(self) -> list[int]:
        return indptr_from_lengths(self.page_counts_cpu)

    @property
    def last_page_lens_cpu(self) -> list[int]:
        """Tokens on each list's last page: 1..page_size."""
        return [n - (c - 1) * self.page_size for n, c in
                zip(self.kv_lens_cpu, self.page_counts_cpu, strict=True)]


def _chunk_ends(
    lengths_cpu: list[int], page_size: int, device: torch.device
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """For every chunk of every list: (page counts, owning list, index of its last entry)."""
    if any(n < 1 for n in lengths_cpu):
        raise ValueError(f"every KV list needs at least one token; lengths: {lengths_cpu}")
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
    return counts, owner, last_entry


def row_pages(
    req_to_token: torch.Tensor, rows: torch.Tensor, lengths_cpu: list[int], page_size: int
) -> PageLists:
    """Pages of `req_to_token[rows[i], :lengths_cpu[i]]` for every i."""
    device = req_to_token.device
    counts, owner, last_entry = _chunk_ends(lengths_cpu, page_size, device)
    slots = req_to_token[rows.to(device)[owner], last_entry].to(torch.int64)
    return PageLists(list(lengths_cpu), counts, slots // page_size, page_size)


def list_pages(
    kv_indptr_cpu: list[int], kv_indices: torch.Tensor, page_size: int
) -> PageLists:
    """Pages of the slot lists `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`."""
    device = kv_indices.device
    lengths = [b - a for a, b in pairwise(kv_indptr_cpu)]
    counts, owner, last_entry = _chunk_ends(lengths, page_size, device)
    list_starts = torch.tensor(kv_indptr_cpu[:-1], dtype=torch.int64).to(device)
    slots = kv_indices.to(torch.int64)[list_starts[owner] + last_entry]
    return PageLists(lengths, counts, slots // page_size, page_size)
