"""The paging helpers every backend shares (`plugserve.attention.paging`), on hand-made rows,
lists and batches: offsets, page lists, the decode dispatch and the window by position."""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.draft_kv import DraftKVLists
from plugserve.attention.paging import (
    decode_draft_lists,
    decode_page_lists,
    decode_slot_lists,
    fold_window_into_mask,
    gather_row_slots,
    indptr_from_lengths,
    kv_list_page_lists,
    pages_for,
    row_page_lists,
    window_mask_by_position,
)
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode

# prefix 6 on pages of 4 (base 4, tail 2): the prefix's page 0, the original tail (slots 12,
# 13 on page 3), then the branch's draft at offset 2 of its own page 9.
BRANCH = torch.tensor([0, 1, 2, 3, 12, 13, 38])


def _table() -> torch.Tensor:
    table = torch.zeros(3, 12, dtype=torch.int64)
    table[1, :6] = torch.tensor([28, 29, 30, 31, 8, 9])  # pages 7 then 2 (page size 4)
    table[2, :4] = torch.tensor([20, 21, 22, 23])  # page 5, exactly full
    return table


def test_offsets_and_page_counts() -> None:
    assert indptr_from_lengths([3, 1, 2]) == [0, 3, 4, 6]
    assert indptr_from_lengths([]) == [0]
    assert [pages_for(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]


def test_row_pages_name_each_chunk_and_the_last_page_length() -> None:
    pages = row_page_lists(_table(), torch.tensor([1, 2]), [6, 4], 4)
    assert pages.page_ids.tolist() == [7, 2, 5]
    assert pages.owner.tolist() == [0, 0, 1] and pages.column.tolist() == [0, 1, 0]
    assert pages.page_indptr_cpu == [0, 2, 3]
    assert pages.last_page_lens_cpu == [2, 4]
    assert pages.width == 2


def test_an_empty_row_has_no_page() -> None:
    pages = row_page_lists(_table(), torch.tensor([1, 2]), [6, 0], 4)
    assert pages.page_ids.tolist() == [7, 2] and pages.page_counts_cpu == [2, 0]
    assert pages.last_page_lens_cpu == [2, 0]


def test_branch_list_takes_the_branch_page_not_the_prefix_tail() -> None:
    pages = kv_list_page_lists([0, 7], BRANCH, 4)
    assert pages.page_ids.tolist() == [0, 9]
    assert pages.column.tolist() == [0, 1] and pages.width == 2
    assert pages.last_page_lens_cpu == [3]


def test_every_kv_list_needs_a_token() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        kv_list_page_lists([0, 2, 2], torch.tensor([4, 5]), 4)


def test_gather_row_slots() -> None:
    table = torch.arange(20).view(2, 10)
    rows = torch.tensor([1, 0])
    assert gather_row_slots(table, rows, [3, 2]).tolist() == [10, 11, 12, 0, 1]
    assert gather_row_slots(table, rows, [0, 0]).numel() == 0


def _decode_batch(table: torch.Tensor, seq_lens: list[int], num_tokens: int,
                  extra: dict[str, object] | None = None) -> ForwardBatch:
    rows = torch.tensor([1, 2][: len(seq_lens)])
    return ForwardBatch(
        mode=ForwardMode.DRAFT_DECODE, input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.zeros(num_tokens, dtype=torch.int64),
        out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64), req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
        extend_prefix_lens=torch.zeros(len(seq_lens), dtype=torch.int64),
        extend_prefix_lens_cpu=[0] * len(seq_lens),
        extend_seq_lens=torch.ones(len(seq_lens), dtype=torch.int64),
        extend_seq_lens_cpu=[1] * len(seq_lens), req_to_token=table, kv_pool=None,  # type: ignore[arg-type]
        extra=dict(extra or {}),
    )


def test_decode_dispatch_reads_rows_without_lists() -> None:
    fb = _decode_batch(_table(), [6, 4], 2)
    assert decode_draft_lists(fb) is None
    indptr, slots = decode_slot_lists(fb)
    assert indptr == [0, 6, 10] and slots.tolist() == [28, 29, 30, 31, 8, 9, 20, 21, 22, 23]
    assert decode_page_lists(fb, 4).page_ids.tolist() == [7, 2, 5]


def test_decode_dispatch_prefers_the_draft_lists() -> None:
    lists = DraftKVLists(torch.tensor([0, 7, 8]), torch.cat([BRANCH, torch.tensor([5])]), [7, 1])
    fb = _decode_batch(_table(), [6], 2)
    lists.store(fb)
    indptr, slots = decode_slot_lists(fb)
    assert indptr == [0, 7, 8] and slots.tolist()[-2:] == [38, 5]
    assert decode_page_lists(fb, 4).page_ids.tolist() == [0, 9, 1]


def test_decode_dispatch_refuses_branches_without_lists() -> None:
    fb = _decode_batch(_table(), [6], 4)  # topk 4 queries for one request, no lists
    with pytest.raises(ValueError, match="4 queries for 1 requests: a topk>1 draft decode "
                       "must give each branch its KV list"):
        decode_slot_lists(fb)


def test_window_counts_positions_not_rows() -> None:
    # A tree verify after a prefix of 4: nodes at depth 0, 1, 1 (positions 4, 5, 5).
    mask = window_mask_by_position(4, torch.tensor([4, 5, 5]), window=3)
    assert mask.tolist() == [
        [False, False, True, True, True, True, True],  # keys 2..4 (and later nodes' 5s)
        [False, False, False, True, True, True, True],
        [False, False, False, True, True, True, True],  # row 2 still sees position 3
    ]
    tree = torch.ones(3, 7, dtype=torch.bool)
    folded = fold_window_into_mask(tree.reshape(-1), torch.tensor([4, 5, 5]), [4], [3], 3)
    assert torch.equal(folded.view(3, 7), mask)
