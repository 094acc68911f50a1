"""Extend kernel vs the torch_native reference on random, shuffled paged caches."""

from __future__ import annotations

import pytest
import torch

from plugserve.structs.forward_batch import ForwardMode

HEAD_DIM = 16
KV_HEADS = 2


def _check(factory, compare, tol, fb, *, group: int, dtype=torch.float32, window=None,
           head_dim: int = HEAD_DIM) -> None:
    layer = factory.layer(num_heads=KV_HEADS * group, num_kv_heads=KV_HEADS, head_dim=head_dim,
                          sliding_window=window)
    triton_backend, native = factory.backends(layer, fb.kv_pool.page_size, dtype)
    q = factory.randn(fb.num_tokens, layer.num_heads, head_dim, dtype=dtype)
    got, want = compare(fb, q, layer, triton_backend, native)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol(dtype), f"max abs error {err}"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_without_prefix(factory, compare, tol, page_size, group):
    fb = factory.extend_batch(prefix_lens=[0, 0, 0], extend_lens=[1, 13, 37],
                              page_size=page_size, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              dtype=torch.float32)
    _check(factory, compare, tol, fb, group=group)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_extend_with_cached_prefix(factory, compare, tol, page_size, group):
    # Chunked prefill, a mixed-in decode request (one new token) and a long prefix.
    fb = factory.extend_batch(prefix_lens=[5, 16, 40, 3], extend_lens=[9, 1, 34, 2],
                              page_size=page_size, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              dtype=torch.float32)
    _check(factory, compare, tol, fb, group=group)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_tree_mask_verify(factory, compare, tol, page_size, group):
    fb = factory.extend_batch(prefix_lens=[7, 20, 1], extend_lens=[6, 9, 4],
                              page_size=page_size, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              dtype=torch.float32, tree_mask=True,
                              mode=ForwardMode.TARGET_VERIFY)
    _check(factory, compare, tol, fb, group=group)


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_sliding_window(factory, compare, tol, window, page_size):
    fb = factory.extend_batch(prefix_lens=[0, 11, 30], extend_lens=[21, 6, 40],
                              page_size=page_size, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              dtype=torch.float32)
    _check(factory, compare, tol, fb, group=3, window=window)


def test_sliding_window_with_tree_mask(factory, compare, tol):
    fb = factory.extend_batch(prefix_lens=[12, 25], extend_lens=[5, 8], page_size=4,
                              num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                              tree_mask=True, mode=ForwardMode.TARGET_VERIFY)
    _check(factory, compare, tol, fb, group=1, window=6)


def test_draft_extend_mode(factory, compare, tol):
    fb = factory.extend_batch(prefix_lens=[9, 4], extend_lens=[3, 2], page_size=4,
                              num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                              mode=ForwardMode.DRAFT_EXTEND)
    _check(factory, compare, tol, fb, group=3)


@pytest.mark.parametrize("head_dim", [8, 24])
def test_head_dim_not_a_tile_multiple(factory, compare, tol, head_dim):
    fb = factory.extend_batch(prefix_lens=[3, 10], extend_lens=[17, 5], page_size=4,
                              num_kv_heads=KV_HEADS, head_dim=head_dim, dtype=torch.float32)
    _check(factory, compare, tol, fb, group=3, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(factory, compare, tol, dtype):
    fb = factory.extend_batch(prefix_lens=[6, 0], extend_lens=[10, 19], page_size=4,
                              num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                              tree_mask=False)
    _check(factory, compare, tol, fb, group=3, dtype=dtype)
