"""The bf16 prefill attention on AMX tiles (`csrc/kernels/prefill_attention_amx.cpp`) against
the float32 reference, at the bf16 tolerance of tests/kernels/test_prefill_attention.py (the
kernel, like the vector one, multiplies bf16 inputs and rounds the probabilities to bf16).
Runs where the kernel applies (a CPU with AMX-BF16 and the kernels' avx512_bf16 copy built
with AMX); `amx_applies` itself is checked everywhere."""

from __future__ import annotations

import pytest
import torch

from plugserve.kernels import build
from plugserve.kernels import prefill_attention as pa
from tests.kernels.test_prefill_attention import _case as make_case

BF16 = torch.bfloat16

needs_amx = pytest.mark.skipif(
    not pa.amx_applies(BF16, 64),
    reason="no AMX kernel here (no AMX-BF16, the OS refused the tiles, or built without AMX)",
)


def _case(
    heads: int, kv_heads: int, dim: int, tokens: int, prefix: int, seed: int,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return make_case(BF16, heads, kv_heads, dim, tokens, prefix, seed, q_scale)


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == BF16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2**-7)


def test_amx_applies_to_bf16_with_head_dims_of_whole_tile_rows() -> None:
    assert not pa.amx_applies(torch.float32, 64)
    assert not pa.amx_applies(torch.float16, 64)
    assert not pa.amx_applies(BF16, 48)
    assert not pa.amx_applies(BF16, 0)
    assert pa.amx_applies(BF16, 128) == pa.amx_applies(BF16, 64)


SHAPES = [  # heads, kv_heads, head_dim: groups 1, 3, 4, 8; head_dim 32, 64, 128
    (4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 64), (6, 3, 32),
]


@needs_amx
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize(
    "tokens,prefix", [(1, 0), (15, 0), (16, 0), (17, 5), (63, 1), (65, 70), (200, 0)]
)
@pytest.mark.parametrize("window", [None, 1, 13, 64, 100])
def test_matches_the_reference(
    heads: int, kv_heads: int, dim: int, tokens: int, prefix: int, window: int | None
) -> None:
    q, k, v = _case(heads, kv_heads, dim, tokens, prefix, seed=tokens * dim + prefix)
    out = build.ops().prefill_attention_amx(q, k, v, dim**-0.5, prefix, window or 0)
    _check(out, pa.reference(q, k, v, dim**-0.5, prefix, window))


@needs_amx
@pytest.mark.parametrize("window", [None, 37, 300])
def test_many_key_blocks(window: int | None) -> None:
    """A long prefix and prompt: many 64-key blocks per query block, windows within a block
    and across blocks; `prefill_attention` runs the AMX kernel here."""
    q, k, v = _case(9, 3, 64, 333, 400, seed=7)
    out = pa.prefill_attention(q, k, v, 0.125, 400, window)
    torch.testing.assert_close(
        out, build.ops().prefill_attention_amx(q, k, v, 0.125, 400, window or 0), atol=0, rtol=0
    )
    _check(out, pa.reference(q, k, v, 0.125, 400, window))


@needs_amx
@pytest.mark.parametrize("dim", [64, 128])
def test_large_scores_rescale_the_running_sums(dim: int) -> None:
    """Scores in the hundreds, with keys that grow towards the past: a row's max moves from
    one key block to the next, and the accumulators are rescaled each time."""
    q, k, v = _case(8, 2, dim, 300, 300, seed=3, q_scale=8.0)
    growth = torch.linspace(1.0, 4.0, k.shape[0])[:, None, None]
    k = (k.float() * growth).to(BF16)
    out = pa.prefill_attention(q, k, v, dim**-0.5, 300)
    scores = torch.einsum("ehd,shd->hes", q.float()[:, :2], k.float()[:, :1].expand(-1, 2, -1))
    assert scores.abs().max() * dim**-0.5 > 100  # the case is what it says
    # Large scores amplify the bf16 rounding of the probabilities less than the reference's
    # float32 ones: the bf16 tolerance plus the float32 test's large-score slack.
    ref = pa.reference(q, k, v, dim**-0.5, 300)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2**-7)


@needs_amx
def test_a_window_of_one_returns_each_tokens_own_value() -> None:
    q, k, v = _case(6, 2, 64, 50, 20, seed=4, q_scale=30.0)
    out = pa.prefill_attention(q, k, v, 0.125, 20, window=1)
    torch.testing.assert_close(out, v[20:].repeat_interleave(3, dim=1), atol=0, rtol=0)


@needs_amx
def test_strided_views() -> None:
    """k and v as slices of a fused [S, 2, KVH, D] buffer, q as a transposed view: the same
    result as contiguous copies."""
    q, k, v = _case(9, 3, 64, 70, 30, seed=5)
    kv = torch.stack([k, v], dim=1)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    expected = pa.prefill_attention(q, k, v, 0.125, 30, 40)
    assert not kv[:, 0].is_contiguous() and not q_t.is_contiguous()
    got = pa.prefill_attention(q_t, kv[:, 0], kv[:, 1], 0.125, 30, 40)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # q as the engine passes it: the first heads of a qkv projection's rows, read in place
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 2 * 3 * 64, dtype=q.dtype)], 1)
    q_rows = qkv[:, : 9 * 64].view(q.shape)
    assert q_rows.stride() == (qkv.shape[1], 64, 1)
    got = pa.prefill_attention(q_rows, k, v, 0.125, 30, 40)
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@needs_amx
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
def test_the_vector_kernel_still_runs_on_request(heads: int, kv_heads: int, dim: int) -> None:
    """amx=False keeps the vector kernel, which stays correct in bf16 on this CPU."""
    q, k, v = _case(heads, kv_heads, dim, 130, 20, seed=8)
    out = pa.prefill_attention(q, k, v, dim**-0.5, 20, 50, amx=False)
    _check(out, pa.reference(q, k, v, dim**-0.5, 20, 50))


def test_other_dtypes_and_head_dims_are_errors() -> None:
    if not pa.available():
        pytest.skip(f"prefill_attention kernel unavailable: {pa.why_unavailable()}")
    q, k, v = _case(4, 2, 48, 10, 0, seed=6)
    with pytest.raises(RuntimeError, match="head_dim a multiple of 32"):
        build.ops().prefill_attention_amx(q, k, v, 0.125, 0, 0)
    q, k, v = (t.float() for t in _case(4, 2, 64, 10, 0, seed=6))
    with pytest.raises(RuntimeError, match="bfloat16"):
        build.ops().prefill_attention_amx(q, k, v, 0.125, 0, 0)
