"""The call arguments themselves, on hand-made rows and lists (no kernel involved)."""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.paging import kv_list_page_lists
from plugserve.testing.paged_cases import Cases, Shape
from plugserve_attention_fa3.metadata import build_decode_metadata, build_extend_metadata
from plugserve_attention_fa3.page_table import PageTableBuffer, PageTableOverflow
from plugserve_attention_fa3.pages import distinct_page_lists

CPU = torch.device("cpu")

# prefix 6 on pages of 4 (base 4, tail 2): the prefix's page 0, the original tail (slots 12,
# 13 on page 3), then the branch's draft at offset 2 of its own page 9.
BRANCH = torch.tensor([0, 1, 2, 3, 12, 13, 38])


def _buffer(max_rows: int = 8) -> PageTableBuffer:
    return PageTableBuffer(max_rows=max_rows, device=CPU)


def test_the_reverted_fill_needs_a_column_more_than_the_row_has() -> None:
    entries = distinct_page_lists([0, 7], BRANCH, 4)
    assert entries.page_ids.tolist() == [0, 3, 9]
    assert entries.column.tolist() == [0, 1, 2]
    assert entries.width == 2  # the step-tight row: column 2 lands in the next row


def test_scatter_past_the_row_lands_in_the_next_row() -> None:
    buffer = _buffer(max_rows=3)
    buffer.fit_rows(8, 4)
    two = torch.cat([BRANCH, BRANCH + 64])  # a second, identical-looking branch list
    table = buffer.table(distinct_page_lists([0, 7, 14], two, 4))
    assert table.shape == (2, 2)
    # Row 0 got the original tail page where its branch page belongs, and its third page
    # spilled into row 1's first column (which row 1 then wrote again).
    assert table[0].tolist() == [0, 3]
    fixed = buffer.table(kv_list_page_lists([0, 7, 14], two, 4))
    assert fixed.tolist() == [[0, 9], [16, 25]]


def test_page_table_overflow_names_the_sizes() -> None:
    buffer = _buffer(max_rows=1)
    buffer.fit_rows(4, 4)
    with pytest.raises(PageTableOverflow, match="2 rows x 1 pages does not fit the buffer of "
                       "1 rows x 1 pages"):
        buffer.table(kv_list_page_lists([0, 1, 2], torch.tensor([4, 8]), 4))


def test_causal_extend_call(cases: Cases) -> None:
    fb = cases.extend(Shape(4), prefix_lens=[0, 5], extend_lens=[3, 6])
    meta = build_extend_metadata(fb, 4, _buffer())
    assert meta.tree is None and meta.main.causal
    assert meta.main.cache_seqlens.tolist() == [3, 11]
    assert meta.main.cu_seqlens_q.tolist() == [0, 3, 9] and meta.main.max_seqlen_q == 6
    assert meta.main.page_table.shape == (2, 3)
    assert meta.main.page_table.dtype == torch.int32
    row = int(fb.req_pool_indices[1])
    assert meta.main.page_table[1].tolist() == [int(fb.req_to_token[row, p]) // 4
                                                for p in (0, 4, 8)]


def test_tree_verify_calls(cases: Cases) -> None:
    fb = cases.extend(Shape(4), prefix_lens=[5], extend_lens=[3], tree_mask=True)
    assert fb.custom_mask is not None
    fb.custom_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0],
                                   [1, 1, 1, 1, 1, 1, 1, 0],
                                   [1, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool).reshape(-1)
    meta = build_extend_metadata(fb, 4, _buffer())
    assert not meta.main.causal and meta.main.cache_seqlens.tolist() == [5]
    assert meta.tree is not None
    assert meta.tree.page_size == 1 and meta.tree.cache_seqlens.tolist() == [1, 2, 2]
    row = fb.req_to_token[int(fb.req_pool_indices[0])]
    s = [int(row[p]) for p in range(8)]
    assert meta.tree.page_table.tolist() == [[s[5], 0], [s[5], s[6]], [s[5], s[7]]]
    # Window 2 on the tree (positions 5, 6, 6): keys at positions > q - 2, by slots.
    fb.positions = torch.tensor([5, 6, 6])
    meta = build_extend_metadata(fb, 4, _buffer())
    windowed = meta.windowed_verify(2)
    assert windowed.page_size == 1 and not windowed.causal
    assert windowed.cache_seqlens.tolist() == [2, 2, 2]
    assert windowed.page_table.tolist() == [[s[4], s[5]], [s[5], s[6]], [s[5], s[7]]]


def test_tree_mask_hiding_the_prefix_is_refused(cases: Cases) -> None:
    fb = cases.extend(Shape(4), prefix_lens=[2], extend_lens=[2], tree_mask=True)
    fb.custom_mask = torch.tensor([1, 0, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"verify requests \[0\]: the tree mask hides"):
        build_extend_metadata(fb, 4, _buffer())


def test_draft_decode_row_per_branch(cases: Cases) -> None:
    fb = cases.draft_decode(Shape(4), prefix_lens=[6, 9], topk=3, step=1, num_steps=2)
    meta = build_decode_metadata(fb, 4, _buffer())
    assert meta.main.cache_seqlens.tolist() == [8, 8, 8, 11, 11, 11]
    assert meta.main.page_table.shape == (6, 3)  # step-tight: the longest list's pages
    assert meta.main.cu_seqlens_q.tolist() == list(range(7))
