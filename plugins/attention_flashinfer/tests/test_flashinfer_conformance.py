"""The backend, with FlashInfer's CPU interpreter as its kernels, equals torch_native.

Every case builds the metadata exactly as on CUDA, plans the wrappers and runs them; only the
kernels are the interpreter of `reference.py`. Random paged caches with shuffled pages:
extend with cached prefixes, mixed lengths, sliding windows, tree-verify masks (a tree's
window counts token positions), decode, and topk>1 draft decode in the
holey layout at page sizes 1, 4 and 16.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plugserve.structs.forward_batch import ForwardBatch
from plugserve.testing.paged_cases import (
    TOLERANCE,
    Cases,
    Shape,
    max_error,
    native,
    native_tree_window,
    run_backend,
)
from plugserve_attention_flashinfer import reference
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend


def _check(cases: Cases, shape: Shape, fb: ForwardBatch, *, spec_topk: int = 1,
           oracle: Callable[[ForwardBatch, torch.Tensor, Shape], torch.Tensor] = native) -> None:
    backend = FlashInferAttentionBackend(
        shape.context(cases.device, spec_topk=spec_topk), kernels=reference)
    q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim,
                    dtype=shape.dtype)
    got = run_backend(backend, fb, q, shape)
    want = oracle(fb, q, shape)
    assert got.dtype == shape.dtype
    assert max_error(got, want) <= TOLERANCE[shape.dtype]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
def test_extend_with_cached_prefixes(cases: Cases, page_size: int, heads: tuple[int, int]) -> None:
    shape = Shape(page_size, num_heads=heads[0], num_kv_heads=heads[1])
    fb = cases.extend(shape, prefix_lens=[0, 5, 16, 33], extend_lens=[7, 1, 12, 3])
    _check(cases, shape, fb)


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_sliding_window(cases: Cases, page_size: int) -> None:
    shape = Shape(page_size, sliding_window=6)
    fb = cases.extend(shape, prefix_lens=[0, 9, 21], extend_lens=[11, 4, 2])
    _check(cases, shape, fb)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_tree_verify_mask(cases: Cases, page_size: int) -> None:
    shape = Shape(page_size)
    fb = cases.extend(shape, prefix_lens=[3, 17, 30], extend_lens=[6, 8, 5], tree_mask=True)
    _check(cases, shape, fb)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [3, 12])
def test_tree_verify_window_counts_positions(cases: Cases, page_size: int, window: int) -> None:
    """A node at depth d sits at prefix + d whatever its row: the window counts positions."""
    shape = Shape(page_size, sliding_window=window)
    fb = cases.extend(shape, prefix_lens=[3, 17, 30], extend_lens=[6, 8, 5], tree_mask=True)
    _check(cases, shape, fb, oracle=native_tree_window)


@pytest.mark.parametrize("window", [3, 12])
def test_chain_verify_window(cases: Cases, window: int) -> None:
    """For a chain, positions and rows agree: torch_native's own window is the oracle."""
    shape = Shape(4, sliding_window=window)
    fb = cases.extend(shape, prefix_lens=[3, 17], extend_lens=[6, 8], tree_mask=True, chain=True)
    _check(cases, shape, fb)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_mixed_lengths(cases: Cases, page_size: int, window: int | None) -> None:
    shape = Shape(page_size, sliding_window=window)
    fb = cases.decode(shape, seq_lens=[1, 4, 5, 16, 17, 40])
    _check(cases, shape, fb)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("lists", ["core", "lanes"])
def test_topk_draft_decode_holey_layout(
    cases: Cases, page_size: int, topk: int, lists: str
) -> None:
    shape = Shape(page_size)
    for step in (0, 2):
        fb = cases.draft_decode(shape, prefix_lens=[3, 8, 14], topk=topk, step=step,
                                num_steps=3, lists=lists)
        _check(cases, shape, fb, spec_topk=topk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(cases: Cases, dtype: torch.dtype) -> None:
    shape = Shape(4, dtype=dtype)
    _check(cases, shape, cases.extend(shape, prefix_lens=[4, 10], extend_lens=[3, 6],
                                      tree_mask=True))
    _check(cases, shape, cases.decode(shape, seq_lens=[3, 19]))
