"""The backend through the engine-facing `forward` (store K/V, then attend) and its errors."""

from __future__ import annotations

import pytest
import torch

from plugserve.structs.forward_batch import ForwardMode

KV_HEADS = 2
HEAD_DIM = 16


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_forward_stores_then_attends_like_torch_native(factory, tol, mode):
    if mode == "extend":
        fb = factory.extend_batch(prefix_lens=[3, 12], extend_lens=[6, 4], page_size=4,
                                  num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32)
    else:
        fb = factory.decode_batch(seq_lens=[3, 25], page_size=4, num_kv_heads=KV_HEADS,
                                  head_dim=HEAD_DIM, dtype=torch.float32)
    layer = factory.layer(num_heads=6, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, native = factory.backends(layer, 4, torch.float32)
    q = factory.randn(fb.num_tokens, 6, HEAD_DIM, dtype=torch.float32)
    k = factory.randn(fb.num_tokens, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    v = factory.randn(fb.num_tokens, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    triton_backend.init_forward_metadata(fb)
    got = triton_backend.forward(q, k, v, layer, fb)
    assert torch.equal(fb.kv_pool.get_k(layer.layer_id)[fb.out_cache_loc], k)
    native.init_forward_metadata(fb)
    want = native.forward(q, k, v, layer, fb)
    assert (got - want).abs().max().item() <= tol(torch.float32)


def test_missing_metadata_is_a_clear_error(factory):
    fb = factory.decode_batch(seq_lens=[3], page_size=1, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    layer = factory.layer(num_heads=KV_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, _ = factory.backends(layer, 1, torch.float32)
    q = factory.randn(1, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="call init_forward_metadata"):
        triton_backend.forward_decode(q, layer, fb)
    triton_backend.init_forward_metadata(fb)
    fb.mode = ForwardMode.EXTEND
    with pytest.raises(RuntimeError, match="built for decode"):
        triton_backend.forward_extend(q, layer, fb)


def test_heads_must_group_evenly(factory):
    layer = factory.layer(num_heads=5, num_kv_heads=2, head_dim=HEAD_DIM)
    from plugserve_attention_triton.backend import TritonAttentionBackend

    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonAttentionBackend(factory.context(layer, 1, torch.float32))


def test_non_contiguous_query_rows(factory, compare, tol):
    fb = factory.decode_batch(seq_lens=[9, 2], page_size=4, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    layer = factory.layer(num_heads=KV_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, native = factory.backends(layer, 4, torch.float32)
    # Every other head of a wider tensor: a non-unit head stride.
    q = factory.randn(fb.num_tokens, 2 * KV_HEADS, HEAD_DIM, dtype=torch.float32)[:, ::2]
    got, want = compare(fb, q, layer, triton_backend, native)
    assert (got - want).abs().max().item() <= tol(torch.float32)
