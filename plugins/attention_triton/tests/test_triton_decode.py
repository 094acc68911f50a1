"""Split-KV decode kernels vs the torch_native reference on random, shuffled paged caches."""

from __future__ import annotations

import pytest
import torch

HEAD_DIM = 16
KV_HEADS = 2


def _check(factory, compare, tol, fb, *, group: int, dtype=torch.float32, window=None,
           max_kv_splits: int = 1, min_tokens_per_split: int = 1,
           head_dim: int = HEAD_DIM) -> None:
    layer = factory.layer(num_heads=KV_HEADS * group, num_kv_heads=KV_HEADS, head_dim=head_dim,
                          sliding_window=window)
    triton_backend, native = factory.backends(layer, fb.kv_pool.page_size, dtype,
                                              max_kv_splits=max_kv_splits,
                                              min_tokens_per_split=min_tokens_per_split)
    q = factory.randn(fb.num_tokens, layer.num_heads, head_dim, dtype=dtype)
    got, want = compare(fb, q, layer, triton_backend, native)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol(dtype), f"max abs error {err}"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("max_kv_splits", [1, 3])
def test_decode(factory, compare, tol, page_size, group, max_kv_splits):
    fb = factory.decode_batch(seq_lens=[1, 6, 33, 70], page_size=page_size,
                              num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32)
    _check(factory, compare, tol, fb, group=group, max_kv_splits=max_kv_splits,
           min_tokens_per_split=8)


def test_more_splits_than_tiles(factory, compare, tol):
    # Splits of a few tokens each, some of them empty after rounding.
    fb = factory.decode_batch(seq_lens=[2, 5, 9], page_size=1, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    _check(factory, compare, tol, fb, group=3, max_kv_splits=8, min_tokens_per_split=1)


@pytest.mark.parametrize("window", [1, 4, 40])
@pytest.mark.parametrize("max_kv_splits", [1, 4])
def test_sliding_window(factory, compare, tol, window, max_kv_splits):
    fb = factory.decode_batch(seq_lens=[3, 17, 64], page_size=4, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    _check(factory, compare, tol, fb, group=3, window=window, max_kv_splits=max_kv_splits,
           min_tokens_per_split=4)


@pytest.mark.parametrize("head_dim", [8, 40])
def test_head_dim_not_a_tile_multiple(factory, compare, tol, head_dim):
    fb = factory.decode_batch(seq_lens=[5, 29], page_size=16, num_kv_heads=KV_HEADS,
                              head_dim=head_dim, dtype=torch.float32)
    _check(factory, compare, tol, fb, group=3, head_dim=head_dim, max_kv_splits=2,
           min_tokens_per_split=8)


def test_many_heads_per_kv_head(factory, compare, tol):
    # 20 query heads per KV head: the head tile (32) is wider than the minimum dot size.
    fb = factory.decode_batch(seq_lens=[7, 21], page_size=4, num_kv_heads=1,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    layer = factory.layer(num_heads=20, num_kv_heads=1, head_dim=HEAD_DIM)
    triton_backend, native = factory.backends(layer, 4, torch.float32, max_kv_splits=2,
                                              min_tokens_per_split=8)
    q = factory.randn(fb.num_tokens, 20, HEAD_DIM, dtype=torch.float32)
    got, want = compare(fb, q, layer, triton_backend, native)
    assert (got - want).abs().max().item() <= tol(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(factory, compare, tol, dtype):
    fb = factory.decode_batch(seq_lens=[4, 50], page_size=4, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, dtype=dtype)
    _check(factory, compare, tol, fb, group=3, dtype=dtype, max_kv_splits=3,
           min_tokens_per_split=8)


def test_split_scratch_is_shared_by_layers(factory):
    fb = factory.decode_batch(seq_lens=[12, 30], page_size=4, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, dtype=torch.float32)
    layer = factory.layer(num_heads=KV_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    triton_backend, _ = factory.backends(layer, 4, torch.float32, max_kv_splits=2,
                                         min_tokens_per_split=8)
    triton_backend.init_forward_metadata(fb)
    q = factory.randn(fb.num_tokens, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    first = triton_backend.forward_decode(q, layer, fb)
    second = triton_backend.forward_decode(q, layer, fb)
    assert torch.equal(first, second)
    assert len(fb.attn_metadata._scratch) == 1
