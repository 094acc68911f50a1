"""Index tables and per-branch KV lists, built in plain torch (no kernel runs here)."""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.draft_kv import (
    DraftKVLists,
    build_draft_kv_lists,
    holey_branch_positions,
)
from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.holey_layout import pages_per_branch
from plugserve_attention_triton.metadata import (
    build_decode_metadata,
    build_extend_metadata,
    gather_row_slots,
    indptr_from_lengths,
    kv_split_counts,
)
from plugserve_attention_triton.reference import reference_attention

HEAD_DIM = 8


def test_indptr_and_split_counts():
    assert indptr_from_lengths([3, 1, 2]) == [0, 3, 4, 6]
    assert indptr_from_lengths([]) == [0]
    assert kv_split_counts([1, 8, 9, 100], max_kv_splits=4, min_tokens_per_split=8) == [1, 1, 2, 4]


def test_gather_row_slots():
    table = torch.arange(40).view(4, 10)
    rows = torch.tensor([2, 0])
    assert gather_row_slots(table, rows, [3, 2]).tolist() == [20, 21, 22, 0, 1]
    assert gather_row_slots(table, rows, [0, 0]).numel() == 0


def test_extend_metadata_tables(factory):
    fb = factory.extend_batch(prefix_lens=[2, 0], extend_lens=[3, 4], page_size=4,
                              num_kv_heads=1, head_dim=HEAD_DIM, dtype=torch.float32,
                              tree_mask=True, mode=ForwardMode.TARGET_VERIFY)
    meta = build_extend_metadata(fb)
    assert not meta.is_decode
    assert meta.qo_indptr.tolist() == [0, 3, 7]
    assert meta.kv_indptr.tolist() == [0, 5, 9]
    assert meta.first_query_pos.tolist() == [2, 0]
    assert meta.mask_indptr is not None and meta.mask_indptr.tolist() == [0, 15, 31]
    assert meta.custom_mask is not None and meta.custom_mask.dtype == torch.uint8
    rows = fb.req_pool_indices.tolist()
    assert meta.kv_indices[:5].tolist() == fb.req_to_token[rows[0], :5].tolist()
    assert meta.kv_indices[5:].tolist() == fb.req_to_token[rows[1], :4].tolist()
    assert meta.max_queries_per_segment == 4


def test_extend_metadata_rejects_a_wrong_mask_size(factory):
    fb = factory.extend_batch(prefix_lens=[2], extend_lens=[3], page_size=1, num_kv_heads=1,
                              head_dim=HEAD_DIM, dtype=torch.float32, tree_mask=True)
    assert fb.custom_mask is not None
    fb.custom_mask = fb.custom_mask[:-1]
    with pytest.raises(ValueError, match="custom_mask has 14 entries but the batch needs 15"):
        build_extend_metadata(fb)


def test_extend_metadata_rejects_inconsistent_lengths(factory):
    fb = factory.extend_batch(prefix_lens=[2], extend_lens=[3], page_size=1, num_kv_heads=1,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    fb.seq_lens_cpu = [6]
    with pytest.raises(ValueError, match="prefix 2 \\+ new 3 tokens != seq_len 6"):
        build_extend_metadata(fb)


def test_decode_metadata_tables():
    indices = torch.tensor([5, 6, 7, 9], dtype=torch.int32)
    meta = build_decode_metadata(kv_indptr_cpu=[0, 3, 4], kv_indices=indices, max_kv_splits=4,
                                 min_tokens_per_split=2)
    assert meta.is_decode and meta.num_queries == 2
    assert meta.kv_indices.dtype == torch.int64
    assert meta.first_query_pos_cpu == [2, 0]
    assert meta.num_kv_splits is not None and meta.num_kv_splits.tolist() == [2, 1]
    assert meta.max_kv_splits == 2
    out, lse = meta.decode_scratch(num_heads=3, head_dim=HEAD_DIM)
    assert out.shape == (2, 3, 2, HEAD_DIM) and lse.shape == (2, 3, 2)
    with pytest.raises(ValueError, match="at least one token"):
        build_decode_metadata(kv_indptr_cpu=[0, 0], kv_indices=indices, max_kv_splits=1,
                              min_tokens_per_split=1)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize("num_steps", [1, 3, 5])
def test_holey_positions_follow_the_design(page_size, num_steps):
    prefix_lens = [1, 7, 16]
    topk = 3
    step = num_steps - 1
    pos = holey_branch_positions(prefix_lens, topk=topk, step=step, num_steps=num_steps,
                                 page_size=page_size)
    assert pos.shape == (3, topk, step + 1)
    n = -(-(page_size - 1 + num_steps) // page_size)
    assert pages_per_branch(page_size, num_steps) == n
    for i, prefix in enumerate(prefix_lens):
        last = prefix % page_size
        base = prefix - last
        for t in range(topk):
            expect = [base + t * n * page_size + last + s for s in range(step + 1)]
            assert pos[i, t].tolist() == expect
            # The branch stays inside its own pages.
            assert expect[-1] < base + (t + 1) * n * page_size
        # Branch 0 continues the prefix; page 1 gives prefix + t*num_steps + s.
        assert pos[i, 0, 0].item() == prefix
        if page_size == 1:
            assert pos[i, topk - 1, 0].item() == prefix + (topk - 1) * num_steps


def test_holey_positions_reject_a_step_outside_the_draft():
    with pytest.raises(ValueError, match="draft step 3"):
        holey_branch_positions([4], topk=2, step=3, num_steps=3, page_size=1)


def test_build_draft_kv_lists_concatenates_prefix_and_path():
    table = torch.arange(100).view(2, 50) + 1000
    rows = torch.tensor([1, 0])
    paths = torch.tensor([[[10, 11], [20, 21]], [[5, 6], [30, 31]]])
    lists = build_draft_kv_lists(table, rows, [3, 2], paths)
    assert lists.kv_lens_cpu == [5, 5, 4, 4]
    assert lists.kv_indptr.tolist() == [0, 5, 10, 14, 18]
    got = lists.kv_indices.tolist()
    assert got[0:5] == [1050, 1051, 1052, 1060, 1061]
    assert got[5:10] == [1050, 1051, 1052, 1070, 1071]
    assert got[10:14] == [1000, 1001, 1005, 1006]
    assert got[14:18] == [1000, 1001, 1030, 1031]


def test_draft_lists_round_trip_through_extra(factory):
    fb, _ = factory.draft_decode_batch(prefix_lens=[3, 8], topk=2, step=1, num_steps=2,
                                       page_size=4, num_kv_heads=1, head_dim=HEAD_DIM,
                                       dtype=torch.float32)
    lists = DraftKVLists.from_batch(fb)
    assert lists is not None and lists.num_queries == 4
    assert lists.kv_lens_cpu == [5, 5, 10, 10]
    fb.extra["draft_kv_lens_cpu"] = [5, 5, 10]
    with pytest.raises(ValueError, match="4 queries but 3 KV lists"):
        DraftKVLists.from_batch(fb)


def test_reference_matches_torch_native_extend(factory, compare, tol):
    """The plain-torch oracle itself agrees with the core reference."""
    fb = factory.extend_batch(prefix_lens=[4, 0], extend_lens=[5, 7], page_size=4,
                              num_kv_heads=2, head_dim=HEAD_DIM, dtype=torch.float32,
                              tree_mask=True, mode=ForwardMode.TARGET_VERIFY)
    layer = factory.layer(num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM, sliding_window=4)
    _, native = factory.backends(layer, 4, torch.float32)
    q = factory.randn(fb.num_tokens, 6, HEAD_DIM, dtype=torch.float32)
    native.init_forward_metadata(fb)
    want = native.forward_extend(q, layer, fb)
    meta = build_extend_metadata(fb)
    got = reference_attention(q, fb.kv_pool.get_k(3), fb.kv_pool.get_v(3), meta,
                              scaling=layer.scaling, sliding_window=4)
    assert (got - want).abs().max().item() <= tol(torch.float32)
