"""topk>1 draft decode: every branch of every request is a query with its own KV list.

The oracle runs the core's torch_native decode on a synthetic batch with one req_to_token row
per branch holding exactly that branch's list (prefix + path), so it shares no code with the
list builder or the kernels. The plain-torch `reference_attention` is checked too.
"""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.draft_kv import DRAFT_KV_INDICES, DraftKVLists
from plugserve.attention.torch_native import TorchNativeBackend
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.structs.holey_layout import pages_per_branch
from plugserve_attention_triton.reference import reference_attention

HEAD_DIM = 16
KV_HEADS = 2


def _per_branch_oracle(fb: ForwardBatch, q: torch.Tensor, layer, native: TorchNativeBackend):
    lists = DraftKVLists.from_batch(fb)
    assert lists is not None
    lens = lists.kv_lens_cpu
    indptr = lists.kv_indptr_cpu()
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for j, n in enumerate(lens):
        table[j, :n] = lists.kv_indices[indptr[j] : indptr[j + 1]].cpu()
    device = fb.req_to_token.device
    ints = torch.tensor(lens, dtype=torch.int64, device=device)
    oracle = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=fb.input_ids, positions=fb.positions,
        out_cache_loc=fb.out_cache_loc,
        req_pool_indices=torch.arange(len(lens), device=device), seq_lens=ints,
        extend_prefix_lens=ints - 1, extend_seq_lens=torch.ones_like(ints),
        req_to_token=table.to(device), kv_pool=fb.kv_pool, seq_lens_cpu=list(lens),
        extend_prefix_lens_cpu=[n - 1 for n in lens], extend_seq_lens_cpu=[1] * len(lens),
    )
    native.init_forward_metadata(oracle)
    return native.forward_decode(q, layer, oracle)


@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("step", [0, 2])
def test_draft_decode_matches_per_branch_decode(factory, tol, topk, page_size, step):
    fb, _ = factory.draft_decode_batch(prefix_lens=[1, 9, 30], topk=topk, step=step,
                                       num_steps=3, page_size=page_size, num_kv_heads=KV_HEADS,
                                       head_dim=HEAD_DIM, dtype=torch.float32)
    layer = factory.layer(num_heads=KV_HEADS * 3, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, native = factory.backends(layer, page_size, torch.float32, max_kv_splits=2,
                                              min_tokens_per_split=8)
    q = factory.randn(fb.num_tokens, layer.num_heads, HEAD_DIM, dtype=torch.float32)
    assert fb.num_tokens == 3 * topk
    triton_backend.init_forward_metadata(fb)
    got = triton_backend.forward_decode(q, layer, fb)
    want = _per_branch_oracle(fb, q, layer, native)
    assert (got - want).abs().max().item() <= tol(torch.float32)
    k_buffer, v_buffer = fb.kv_pool.get_k(layer.layer_id), fb.kv_pool.get_v(layer.layer_id)
    ref = reference_attention(q, k_buffer, v_buffer, fb.attn_metadata, scaling=layer.scaling)
    assert (ref - want).abs().max().item() <= tol(torch.float32)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 3])
def test_draft_decode_gqa_and_window(factory, tol, group, window):
    fb, _ = factory.draft_decode_batch(prefix_lens=[6, 21], topk=2, step=3, num_steps=4,
                                       page_size=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                       dtype=torch.float32)
    layer = factory.layer(num_heads=KV_HEADS * group, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          sliding_window=window)
    triton_backend, native = factory.backends(layer, 4, torch.float32, max_kv_splits=3,
                                              min_tokens_per_split=4)
    q = factory.randn(fb.num_tokens, layer.num_heads, HEAD_DIM, dtype=torch.float32)
    triton_backend.init_forward_metadata(fb)
    got = triton_backend.forward_decode(q, layer, fb)
    want = _per_branch_oracle(fb, q, layer, native)
    assert (got - want).abs().max().item() <= tol(torch.float32)


def test_draft_decode_half_precision(factory, tol, upcast):
    fb, _ = factory.draft_decode_batch(prefix_lens=[5, 14], topk=4, step=1, num_steps=2,
                                       page_size=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                       dtype=torch.float16)
    layer = factory.layer(num_heads=KV_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, native = factory.backends(layer, 4, torch.float16)
    q = factory.randn(fb.num_tokens, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    triton_backend.init_forward_metadata(fb)
    got = triton_backend.forward_decode(q, layer, fb)
    want = _per_branch_oracle(upcast(fb), q.float(), layer, native)
    assert (got.float() - want).abs().max().item() <= tol(torch.float16)


@pytest.mark.parametrize("page_size", [4, 16])
def test_branch_lists_match_whole_page_reads(factory, page_size):
    """Lists read the same KV as a page-granular backend reading the copied prefix tail."""
    num_steps, step, topk = 3, 2, 3
    prefix_lens = [6, 17]
    fb, paths = factory.draft_decode_batch(prefix_lens=prefix_lens, topk=topk, step=step,
                                           num_steps=num_steps, page_size=page_size,
                                           num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                           dtype=torch.float32)
    lists = DraftKVLists.from_batch(fb)
    assert lists is not None
    indptr = lists.kv_indptr_cpu()
    k = fb.kv_pool.get_k(3)
    stride = pages_per_branch(page_size, num_steps) * page_size
    for i, prefix in enumerate(prefix_lens):
        row = int(fb.req_pool_indices[i])
        base = prefix - prefix % page_size
        for t in range(topk):
            # A page-granular reader: prefix pages below base, then branch t's own pages.
            begin = base + t * stride
            positions = list(range(base)) + list(range(begin, begin + prefix % page_size + step + 1))
            paged_slots = fb.req_to_token[row, positions]
            query = i * topk + t
            list_slots = lists.kv_indices[indptr[query] : indptr[query + 1]]
            assert torch.equal(k[paged_slots], k[list_slots])
            assert paths[i, t, -1].item() == positions[-1]


def test_topk1_draft_decode_without_lists_reads_rows(factory, compare, tol):
    fb = factory.decode_batch(seq_lens=[4, 19], page_size=4, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    fb.mode = ForwardMode.DRAFT_DECODE
    layer = factory.layer(num_heads=KV_HEADS * 3, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, native = factory.backends(layer, 4, torch.float32)
    q = factory.randn(fb.num_tokens, layer.num_heads, HEAD_DIM, dtype=torch.float32)
    got, want = compare(fb, q, layer, triton_backend, native)
    assert (got - want).abs().max().item() <= tol(torch.float32)


def test_topk_gt1_without_lists_is_a_clear_error(factory):
    fb, _ = factory.draft_decode_batch(prefix_lens=[5], topk=2, step=0, num_steps=2,
                                       page_size=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                       dtype=torch.float32)
    fb.extra.clear()
    layer = factory.layer(num_heads=KV_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, _ = factory.backends(layer, 1, torch.float32)
    with pytest.raises(ValueError, match="draft_kv_indptr"):
        triton_backend.init_forward_metadata(fb)


def test_partial_lists_are_a_clear_error(factory):
    fb, _ = factory.draft_decode_batch(prefix_lens=[5], topk=2, step=0, num_steps=2,
                                       page_size=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                       dtype=torch.float32)
    del fb.extra[DRAFT_KV_INDICES]
    layer = factory.layer(num_heads=KV_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, _ = factory.backends(layer, 1, torch.float32)
    with pytest.raises(ValueError, match="lacks"):
        triton_backend.init_forward_metadata(fb)
