"""The compiled few-row linear kernel (float32, and bfloat16 on AVX512-BF16 CPUs) against
F.linear in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugserve.kernels import skinny_linear as sk
from plugserve.model.layers import linear

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not sk.available():
        pytest.skip(f"skinny_linear kernel unavailable: {sk.why_unavailable()}")


def _case(rows: int, n_in: int, n_out: int, bias: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen)
    b = torch.randn(n_out, generator=gen) if bias else None
    return x, w, b  # type: ignore[return-value]


# rows cover every tile remainder (4-row tiles); n_in covers partial 16-float vectors; n_out
# covers partial 4-row weight blocks and more blocks than a thread's grain.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 32])
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (7, 5), (33, 13), (1536, 576), (64, 257)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(rows: int, n_in: int, n_out: int, bias: bool) -> None:
    x, w, b = _case(rows, n_in, n_out, bias, seed=rows * 1000 + n_in + n_out)
    out = sk.skinny_linear(x, w, b)
    ref = sk.reference(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (rows, n_out)
    # float32 sums of n_in products: error well within n_in * eps * |x||w|.
    tol = 4 * n_in**0.5 * torch.finfo(torch.float32).eps * (x.abs().max() * w.abs().max())
    torch.testing.assert_close(out, ref, atol=float(tol) * 4, rtol=1e-6)


@pytest.mark.parametrize("rows", [2, 3, 4, 5])
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (33, 13), (70, 257)])
def test_float32_row_alone_equals_it_in_a_batch(rows: int, n_in: int, n_out: int) -> None:
    """One row of x takes its own walk (each weight block's rows one after another), more
    rows the register tiles: every row's sums are added in the same order, so its float32
    result is bitwise the same alone as beside others (n > 1 samples of one prompt, a
    request alone or in a batch)."""
    x, w, b = _case(rows, n_in, n_out, True, seed=rows + n_in)
    together = sk.skinny_linear(x, w, b)
    for i in range(rows):
        assert torch.equal(sk.skinny_linear(x[i : i + 1], w, b)[0], together[i]), i


# n_in also covers an odd count of whole pair vectors for the one-row walk (two per step):
# 33 and 97 on AVX-512 (one and three of 32 values), 80 on AVX2 (five of 16).
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (7, 5), (33, 13), (1536, 576), (70, 257),
                                        (80, 9), (97, 11)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_matches_float64_rounded_once(rows: int, n_in: int, n_out: int, bias: bool) -> None:
    if not sk.takes_bf16():
        pytest.skip("this CPU has no AVX512-BF16: bf16 stays on the GEMM-library path")
    x, w, b = (None if t is None else t.bfloat16() for t in _case(rows, n_in, n_out, bias, 9))
    assert x is not None and w is not None
    out = sk.skinny_linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n_out)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # The float32 sum is within float32 rounding of the exact one and is rounded to bf16 once:
    # at most one bf16 step (2^-8 relative) from the exact value, plus the float32 error.
    sum_err = 4 * n_in**0.5 * torch.finfo(torch.float32).eps * float(x.abs().max() * w.abs().max())
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + sum_err).all()
    # and it is the exact value's own bf16 rounding wherever that is not a near tie
    assert (out == exact.to(torch.bfloat16)).double().mean() > 0.99


def test_bf16_rows_past_the_limit_take_the_gemm_library() -> None:
    w = torch.randn(40, 64).bfloat16()
    few = torch.randn(sk.MAX_ROWS_BF16, 64).bfloat16()
    assert sk.applies(few, w) == sk.takes_bf16()
    assert not sk.applies(torch.randn(sk.MAX_ROWS_BF16 + 1, 64).bfloat16(), w)
    assert not sk.applies(few, w.float())  # mixed dtypes
    assert not sk.applies(few.half(), w.half())


def test_strided_input_is_read_correctly() -> None:
    x, w, b = _case(6, 64, 40, True, seed=3)
    wide = torch.zeros(6, 128)
    wide[:, ::2] = x
    out = sk.skinny_linear(wide[:, ::2], w, b)
    torch.testing.assert_close(out, sk.reference(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_uses_it_only_where_it_applies() -> None:
    x, w, _ = _case(4, 64, 40, False, seed=4)
    assert sk.applies(x, w)
    assert not sk.applies(torch.randn(sk.MAX_ROWS + 1, 64), w)
    assert not sk.applies(torch.randn(sk.MAX_ROWS_BF16 + 1, 64).bfloat16(), w.bfloat16())
    assert not sk.applies(x[0], w)  # 1-d
    assert not sk.applies(torch.empty(0, 64), w)
    torch.testing.assert_close(linear(x, w, None), sk.reference(x, w, None), atol=1e-4, rtol=1e-5)


def test_bad_shapes_are_refused_with_the_sizes() -> None:
    x, w, _ = _case(2, 64, 8, False, seed=5)
    with pytest.raises(RuntimeError, match="x has 63 columns, w has 64"):
        sk.skinny_linear(x[:, :63], w, None)
    with pytest.raises(RuntimeError, match="bias has 7 values for 8 outputs"):
        sk.skinny_linear(x, w, torch.zeros(7))
    with pytest.raises(RuntimeError, match="must both be float32"):
        sk.skinny_linear(x.double(), w.double(), None)
