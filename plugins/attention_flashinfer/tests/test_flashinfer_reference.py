"""The CPU interpreter of FlashInfer's wrappers: its own semantics, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from plugserve_attention_flashinfer.reference import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
)

WS = torch.zeros(16, dtype=torch.uint8)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _cache(pages: int = 4, page: int = 2, heads: int = 1, dim: int = 4) -> torch.Tensor:
    return torch.randn(pages, page, heads, dim, generator=torch.Generator().manual_seed(0))


def test_decode_reads_pages_in_order_up_to_the_last_page_length() -> None:
    k, v = _cache(), _cache() + 1
    q = torch.randn(1, 1, 4)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    wrapper.plan(i32(0, 2), i32(3, 1), i32(1), 1, 1, 4, 2)
    got = wrapper.run(q, (k, v))
    keys = torch.cat([k[3], k[1, :1]])[:, 0]  # page 3 whole, then 1 token of page 1
    vals = torch.cat([v[3], v[1, :1]])[:, 0]
    want = torch.softmax(q[0, 0] @ keys.T / 2.0, dim=-1) @ vals
    assert torch.allclose(got[0, 0], want, atol=1e-6)


def test_prefill_causal_is_aligned_to_the_end_of_the_kv() -> None:
    k, v = _cache(), _cache()
    q = torch.randn(2, 1, 4)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    wrapper.plan(i32(0, 2), i32(0, 2), i32(0, 1), i32(1), 1, 1, 4, 2, causal=True)
    causal = wrapper.run(q, (k, v))
    # kv_len 3, two queries: they sit at positions 1 and 2; the same as an explicit mask.
    mask = torch.tensor([[True, True, False], [True, True, True]])
    wrapper.plan(i32(0, 2), i32(0, 2), i32(0, 1), i32(1), 1, 1, 4, 2, custom_mask=mask.reshape(-1))
    assert torch.allclose(causal, wrapper.run(q, (k, v)))


@pytest.mark.parametrize(
    ("indptr", "indices", "last", "message"),
    [
        (i32(0, 1), i32(0), i32(0), "last page length 0"),
        (i32(0, 1), i32(0), i32(3), "last page length 3"),
        (i32(0, 1), i32(7), i32(1), r"page ids \[7\] outside"),
        (torch.tensor([0, 1]), i32(0), i32(1), "must be int32"),
        (i32(0, 2), i32(0), i32(1), "ends at 2 but kv_indices has 1"),
    ],
)
def test_refuses_what_a_kernel_would_read_out_of_bounds(
    indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, message: str
) -> None:
    wrapper = BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    with pytest.raises(ValueError, match=message):
        wrapper.plan(indptr, indices, last, 1, 1, 4, 2)
        wrapper.run(torch.randn(1, 1, 4), (_cache(), _cache()))


def test_custom_mask_must_cover_every_block() -> None:
    wrapper = BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    with pytest.raises(ValueError, match="custom_mask has 5 entries"):
        wrapper.plan(i32(0, 2), i32(0, 2), i32(0, 1), i32(1), 1, 1, 4, 2,
                     custom_mask=torch.ones(5, dtype=torch.bool))
