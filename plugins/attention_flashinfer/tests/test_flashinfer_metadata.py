"""The plan arguments themselves, on hand-made rows and lists (no kernels involved)."""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.draft_kv import DraftKVLists
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.testing.paged_cases import Cases, Shape
from plugserve_attention_flashinfer.buffers import IndexBufferOverflow, PageIndexBuffer
from plugserve_attention_flashinfer.metadata import build_decode_metadata, build_extend_metadata

CPU = torch.device("cpu")


def _buffer(max_lists: int = 8) -> PageIndexBuffer:
    return PageIndexBuffer(max_lists=max_lists, device=CPU, sizing="test")


def test_extend_metadata_matches_the_batch(cases: Cases) -> None:
    shape = Shape(4)
    fb = cases.extend(shape, prefix_lens=[0, 5], extend_lens=[3, 6], tree_mask=True)
    meta = build_extend_metadata(fb, 4, _buffer())
    assert not meta.is_decode
    assert meta.qo_indptr is not None and meta.qo_indptr.tolist() == [0, 3, 9]
    assert meta.kv_indptr.tolist() == [0, 1, 4]
    assert meta.kv_last_page_len.tolist() == [3, 3]
    assert meta.kv_indices.dtype == torch.int32
    rows = fb.req_pool_indices.tolist()
    want = [int(fb.req_to_token[rows[0], 0]) // 4] + [
        int(fb.req_to_token[rows[1], p]) // 4 for p in (0, 4, 8)]
    assert meta.kv_indices.tolist() == want
    assert meta.custom_mask is not None and meta.custom_mask.numel() == 3 * 3 + 6 * 11


def test_extend_metadata_rejects_a_mask_of_the_wrong_size(cases: Cases) -> None:
    fb = cases.extend(Shape(4), prefix_lens=[2], extend_lens=[3], tree_mask=True)
    assert fb.custom_mask is not None
    fb.custom_mask = fb.custom_mask[:-1]
    with pytest.raises(ValueError, match="custom_mask has 14 entries but the batch needs 15"):
        build_extend_metadata(fb, 4, _buffer())


def test_decode_metadata_one_entry_per_branch(cases: Cases) -> None:
    fb = cases.draft_decode(Shape(4), prefix_lens=[6, 9], topk=3, step=1, num_steps=2)
    meta = build_decode_metadata(fb, 4, _buffer(max_lists=6))
    lists = DraftKVLists.from_batch(fb)
    assert lists is not None
    assert meta.kv_lens_cpu == lists.kv_lens_cpu == [8, 8, 8, 11, 11, 11]
    assert meta.kv_indptr.tolist() == [0, 2, 4, 6, 9, 12, 15]
    assert meta.kv_last_page_len.tolist() == [4, 4, 4, 3, 3, 3]


def test_decode_without_lists_needs_one_query_per_request(cases: Cases) -> None:
    fb = cases.draft_decode(Shape(4), prefix_lens=[6], topk=2, step=0, num_steps=2)
    fb.extra.clear()
    with pytest.raises(ValueError, match="2 queries for 1 requests"):
        build_decode_metadata(fb, 4, _buffer())


def test_buffer_overflow_names_the_numbers() -> None:
    buffer = _buffer(max_lists=2)
    buffer.fit_rows(8, 4)  # 2 pages per row -> 4 page ids
    assert buffer.write(torch.arange(4), 2).tolist() == [0, 1, 2, 3]
    with pytest.raises(IndexBufferOverflow, match=r"needs 5 page ids for 3 KV lists but its "
                       r"buffer holds 4 \(test = 2 lists x 2 pages per row\)"):
        buffer.write(torch.arange(5), 3)


def test_decode_metadata_is_rebuilt_from_the_batch_not_the_mode(cases: Cases) -> None:
    fb = cases.decode(Shape(1), seq_lens=[2, 3])
    assert isinstance(fb, ForwardBatch) and fb.mode is ForwardMode.DECODE
    meta = build_decode_metadata(fb, 1, _buffer())
    assert meta.is_decode and meta.kv_indptr.tolist() == [0, 2, 5]
    assert meta.kv_last_page_len.tolist() == [1, 1]
