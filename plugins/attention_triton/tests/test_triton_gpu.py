"""Compiled kernels on CUDA: the same checks at bf16/fp16/fp32 and at model-like shapes.

Skipped without CUDA, or when TRITON_INTERPRET is on (the kernels would not be compiled).
"""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.draft_kv import DraftKVLists
from plugserve.structs.forward_batch import ForwardMode
from plugserve_attention_triton.reference import reference_attention

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error, scaled down where |want| > 1 (half types round relative to size)."""
    scale = want.float().abs().clamp(min=1.0)
    return ((got.float() - want.float()).abs() / scale).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_on_cuda(gpu_factory, compare, tol, dtype, page_size, head_dim):
    fb = gpu_factory.extend_batch(prefix_lens=[0, 37, 300], extend_lens=[129, 1, 200],
                                  page_size=page_size, num_kv_heads=2, head_dim=head_dim,
                                  dtype=dtype)
    layer = gpu_factory.layer(num_heads=8, num_kv_heads=2, head_dim=head_dim)
    triton_backend, native = gpu_factory.backends(layer, page_size, dtype)
    q = gpu_factory.randn(fb.num_tokens, 8, head_dim, dtype=dtype)
    got, want = compare(fb, q, layer, triton_backend, native)
    assert _error(got, want) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 64])
def test_tree_verify_on_cuda(gpu_factory, compare, tol, dtype, window):
    fb = gpu_factory.extend_batch(prefix_lens=[90, 513], extend_lens=[8, 16], page_size=16,
                                  num_kv_heads=2, head_dim=128, dtype=dtype, tree_mask=True,
                                  mode=ForwardMode.TARGET_VERIFY)
    layer = gpu_factory.layer(num_heads=6, num_kv_heads=2, head_dim=128, sliding_window=window)
    triton_backend, native = gpu_factory.backends(layer, 16, dtype)
    q = gpu_factory.randn(fb.num_tokens, 6, 128, dtype=dtype)
    got, want = compare(fb, q, layer, triton_backend, native)
    assert _error(got, want) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_on_cuda(gpu_factory, compare, tol, dtype, page_size, window):
    fb = gpu_factory.decode_batch(seq_lens=[1, 77, 1000, 4097], page_size=page_size,
                                  num_kv_heads=8, head_dim=128, dtype=dtype)
    layer = gpu_factory.layer(num_heads=32, num_kv_heads=8, head_dim=128,
                              sliding_window=window)
    triton_backend, native = gpu_factory.backends(layer, page_size, dtype)
    q = gpu_factory.randn(fb.num_tokens, 32, 128, dtype=dtype)
    got, want = compare(fb, q, layer, triton_backend, native)
    assert _error(got, want) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_decode_on_cuda(gpu_factory, tol, dtype, topk, page_size):
    fb, _ = gpu_factory.draft_decode_batch(prefix_lens=[5, 300, 1030], topk=topk, step=2,
                                           num_steps=4, page_size=page_size, num_kv_heads=2,
                                           head_dim=128, dtype=dtype)
    layer = gpu_factory.layer(num_heads=6, num_kv_heads=2, head_dim=128)
    triton_backend, _ = gpu_factory.backends(layer, page_size, dtype)
    q = gpu_factory.randn(fb.num_tokens, 6, 128, dtype=dtype)
    triton_backend.init_forward_metadata(fb)
    got = triton_backend.forward_decode(q, layer, fb)
    lists = DraftKVLists.from_batch(fb)
    assert lists is not None and lists.num_queries == 3 * topk
    want = reference_attention(q.float(), fb.kv_pool.get_k(layer.layer_id).float(),
                               fb.kv_pool.get_v(layer.layer_id).float(), fb.attn_metadata,
                               scaling=layer.scaling)
    assert _error(got, want) <= tol(dtype)
