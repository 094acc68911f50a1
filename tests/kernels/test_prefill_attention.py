"""The compiled CPU prefill attention kernel against its reference (SDPA in float32 with an
explicit causal / sliding-window mask).

Tolerances, on |kernel - reference| (both rounded to the dtype):
- float32: 3e-6 times the largest |reference| of the case; 1e-5 times it where the scores are
  large (q scaled up: a score's own float32 rounding, ~1e-7 of its size, is then amplified by
  exp and differs between any two summation orders).
- bfloat16: atol 2e-2 plus one bf16 ulp (2^-7 relative) for the rounding of the result: the
  kernel takes the products in bf16 (as the inputs are) and rounds the probabilities to bf16
  for the value product, so the float32 results before the final rounding are ~1e-4 apart
  and round to neighbouring bf16 values in about a third of the elements.
- float16 (computed in float32): atol 1e-3 plus one fp16 ulp (2^-10 relative).
"""

from __future__ import annotations

import pytest
import torch

from plugserve.kernels import prefill_attention as pa

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not pa.available():
        pytest.skip(f"prefill_attention kernel unavailable: {pa.why_unavailable()}")


def _case(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, tokens: int, prefix: int, seed: int,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, heads, dim, generator=gen) * q_scale).to(dtype)
    k = torch.randn(prefix + tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(prefix + tokens, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v


def _check(out: torch.Tensor, ref: torch.Tensor, large_scores: bool = False) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any() and torch.isfinite(out).all()
    if out.dtype == torch.float32:
        scale = float(ref.abs().max())
        atol, rtol = (1e-5 if large_scores else 3e-6) * scale, 0.0
    elif out.dtype == torch.bfloat16:
        atol, rtol = 2e-2, 2**-7
    else:
        atol, rtol = 1e-3, 2**-10
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


SHAPES = [  # heads, kv_heads, head_dim: groups 1, 3, 4; 40 takes the plain-loop path
    (4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 3, 40), (6, 2, 48),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("tokens,prefix", [(1, 0), (17, 5), (64, 70), (200, 0)])
@pytest.mark.parametrize("window", [None, 13])
def test_matches_the_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, tokens: int, prefix: int,
    window: int | None,
) -> None:
    q, k, v = _case(dtype, heads, kv_heads, dim, tokens, prefix, seed=tokens * dim + prefix)
    out = pa.prefill_attention(q, k, v, dim**-0.5, prefix, window)
    _check(out, pa.reference(q, k, v, dim**-0.5, prefix, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37, 300])
def test_many_key_blocks(dtype: torch.dtype, window: int | None) -> None:
    """A long prefix and prompt: several key blocks per query block, windows within a block
    and across blocks."""
    q, k, v = _case(dtype, 9, 3, 64, 333, 400, seed=7)
    out = pa.prefill_attention(q, k, v, 0.125, 400, window)
    _check(out, pa.reference(q, k, v, 0.125, 400, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
def test_large_scores_rescale_the_running_sums(dtype: torch.dtype, dim: int) -> None:
    """Scores in the hundreds, with keys that grow towards the past: a row's max moves up and
    down from one key block to the next (the blocks run backwards from the diagonal)."""
    q, k, v = _case(dtype, 8, 2, dim, 300, 300, seed=3, q_scale=8.0)
    growth = torch.linspace(4.0, 1.0, k.shape[0])[:, None, None]
    k = (k.float() * growth).to(dtype)
    out = pa.prefill_attention(q, k, v, dim**-0.5, 300)
    ref = pa.reference(q, k, v, dim**-0.5, 300)
    scores = torch.einsum("ehd,shd->hes", q.float()[:, :2], k.float()[:, :1].expand(-1, 2, -1))
    assert scores.abs().max() * dim**-0.5 > 100  # the case is what it says
    _check(out, ref, large_scores=True)


def test_a_window_of_one_returns_each_tokens_own_value() -> None:
    q, k, v = _case(torch.float32, 6, 2, 64, 50, 20, seed=4, q_scale=30.0)
    out = pa.prefill_attention(q, k, v, 0.125, 20, window=1)
    expected = v[20:].repeat_interleave(3, dim=1)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_strided_views() -> None:
    """k and v as slices of a fused [S, 2, KVH, D] buffer and as a transposed [KVH, S, D] one,
    q as a transposed view: the same result as contiguous copies."""
    q, k, v = _case(torch.bfloat16, 9, 3, 64, 70, 30, seed=5)
    kv = torch.stack([k, v], dim=1)  # [S, 2, KVH, D]
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)  # [S, KVH, D] view of [KVH, S, D]
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    expected = pa.prefill_attention(q, k, v, 0.125, 30, 40)
    assert not kv[:, 0].is_contiguous() and not k_t.is_contiguous()
    torch.testing.assert_close(pa.prefill_attention(q, kv[:, 0], kv[:, 1], 0.125, 30, 40), expected,
                               atol=0, rtol=0)
    torch.testing.assert_close(pa.prefill_attention(q_t, k_t, v, 0.125, 30, 40), expected,
                               atol=0, rtol=0)
    # q as the engine passes it: the first heads of a qkv projection's rows, read in place
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        qkv = torch.cat([qd.flatten(1), torch.zeros(qd.shape[0], 2 * 3 * 64, dtype=dtype)], 1)
        q_rows = qkv[:, : 9 * 64].view(qd.shape)
        assert q_rows.stride() == (qkv.shape[1], 64, 1)
        got = pa.prefill_attention(q_rows, kd, vd, 0.125, 30, 40, amx=False)
        assert got.is_contiguous()
        torch.testing.assert_close(got, pa.prefill_attention(qd, kd, vd, 0.125, 30, 40, amx=False),
                                   atol=0, rtol=0)


def test_bad_inputs_are_errors() -> None:
    q, k, v = _case(torch.float32, 4, 2, 64, 10, 5, seed=6)
    with pytest.raises(RuntimeError, match="contiguous in head_dim"):
        pa.prefill_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 0.125, 5)
    with pytest.raises(RuntimeError, match="prefix_len"):
        pa.prefill_attention(q, k, v, 0.125, 4)
    with pytest.raises(RuntimeError, match="share a dtype"):
        pa.prefill_attention(q, k.bfloat16(), v, 0.125, 5)
    with pytest.raises(ValueError, match="window"):
        pa.prefill_attention(q, k, v, 0.125, 5, window=0)


def test_isa_names_the_copy_in_use(kernel_isa: str) -> None:
    assert pa.isa() == (kernel_isa if kernel_isa in pa.VECTOR_ISAS else "none")
