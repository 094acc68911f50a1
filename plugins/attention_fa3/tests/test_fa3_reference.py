"""The CPU interpreter of flash_attn_with_kvcache: its own semantics, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from plugserve_attention_fa3.reference import flash_attn_with_kvcache


def i32(*rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def _cache() -> torch.Tensor:
    return torch.randn(4, 2, 1, 4, generator=torch.Generator().manual_seed(0))


def test_pages_in_table_order_up_to_cache_seqlens() -> None:
    k, v = _cache(), _cache() + 1
    q = torch.randn(1, 1, 4)
    out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=i32(3), page_table=i32([3, 1]),
                                       cu_seqlens_q=i32(0, 1), max_seqlen_q=1,
                                       return_softmax_lse=True)
    keys = torch.cat([k[3], k[1, :1]])[:, 0]
    vals = torch.cat([v[3], v[1, :1]])[:, 0]
    scores = q[0, 0] @ keys.T / 2.0
    assert torch.allclose(out[0, 0], torch.softmax(scores, -1) @ vals, atol=1e-6)
    assert lse.shape == (1, 1) and torch.allclose(lse[0, 0], torch.logsumexp(scores, 0))


def test_causal_and_window_are_aligned_to_the_bottom_right() -> None:
    k, v = _cache(), _cache()
    q = torch.randn(2, 1, 4)
    args = dict(cache_seqlens=i32(4), page_table=i32([0, 2]), cu_seqlens_q=i32(0, 2),
                max_seqlen_q=2)
    causal = flash_attn_with_kvcache(q, k, v, causal=True, **args)
    # Queries sit at positions 2 and 3; a window (1, 0) keeps 1..2 and 2..3.
    local = flash_attn_with_kvcache(q, k, v, causal=True, window_size=(1, 0), **args)
    keys = torch.cat([k[0], k[2]])[:, 0]
    vals = torch.cat([v[0], v[2]])[:, 0]
    want_causal = torch.softmax(q[1, 0] @ keys.T / 2.0, -1) @ vals
    want_local = torch.softmax(q[0, 0] @ keys[1:3].T / 2.0, -1) @ vals[1:3]
    assert torch.allclose(causal[1, 0], want_causal, atol=1e-6)
    assert torch.allclose(local[0, 0], want_local, atol=1e-6)


def test_a_query_with_no_key_gives_zero_and_an_unmergeable_lse() -> None:
    out, lse = flash_attn_with_kvcache(torch.randn(1, 1, 4), _cache(), _cache(),
                                       cache_seqlens=i32(0), page_table=i32([0]),
                                       cu_seqlens_q=i32(0, 1), max_seqlen_q=1,
                                       return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and lse.isinf().all()


@pytest.mark.parametrize(
    ("seqlens", "table", "message"),
    [
        (i32(5), i32([0, 1]), "5 tokens need 3 pages; page_table has 2 columns"),
        (i32(2), i32([9]), r"page ids \[9\] outside"),
        (torch.tensor([2]), i32([0]), "cache_seqlens must be int32"),
        (i32(2), torch.tensor([[0]]), "page_table must be int32"),
    ],
)
def test_refuses_what_a_kernel_would_read_out_of_bounds(
    seqlens: torch.Tensor, table: torch.Tensor, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        flash_attn_with_kvcache(torch.randn(1, 1, 4), _cache(), _cache(), cache_seqlens=seqlens,
                                page_table=table, cu_seqlens_q=i32(0, 1), max_seqlen_q=1)


def test_refuses_what_the_backend_never_asks_for() -> None:
    with pytest.raises(ValueError, match="cache_leftpad"):
        flash_attn_with_kvcache(torch.randn(1, 1, 4), _cache(), _cache(), cache_seqlens=i32(1),
                                page_table=i32([0]), cu_seqlens_q=i32(0, 1), max_seqlen_q=1,
                                cache_leftpad=i32(0))
