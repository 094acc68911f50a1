"""The GEMM that reads bf16 / fp16 weights as they are (widened to float32 in registers)
against F.linear in float64, on every ISA copy of the kernels this CPU runs."""

from __future__ import annotations

import pytest
import torch

from plugserve.kernels import build
from plugserve.kernels import widening_gemm as wg

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


def _case(
    rows: int, n_in: int, n_out: int, x_dtype: torch.dtype, w_dtype: torch.dtype, bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(rows * 7919 + n_in * 31 + n_out)
    x = torch.randn(rows, n_in, generator=gen).to(x_dtype)
    w = torch.randn(n_out, n_in, generator=gen).to(w_dtype)
    b = torch.randn(n_out, generator=gen).to(x_dtype) if bias else None
    return x, w, b


# rows cross the 128-row blocks and the register tiles' remainders; n_in covers partial
# vectors; n_out partial weight blocks.
@pytest.mark.parametrize("rows", [6, 17, 128, 131, 300])
@pytest.mark.parametrize("n_in,n_out", [(64, 96), (33, 13), (576, 257)])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(
    rows: int, n_in: int, n_out: int, w_dtype: torch.dtype, x_dtype: torch.dtype, bias: bool,
) -> None:
    x, w, b = _case(rows, n_in, n_out, x_dtype, w_dtype, bias)
    out = wg.widening_gemm(x, w, b)
    assert out.dtype == x_dtype and out.shape == (rows, n_out)
    exact = torch.nn.functional.linear(
        x.double(), w.double(), None if b is None else b.double()
    )
    # float32 sums of n_in exact products (the widening is exact), rounded once to x's dtype.
    scale = float(x.abs().max() * w.abs().max())
    sum_err = 4 * n_in**0.5 * torch.finfo(torch.float32).eps * scale * 4
    rounding = torch.finfo(x_dtype).eps if x_dtype != torch.float32 else 0.0
    assert ((out.double() - exact).abs() <= exact.abs() * rounding + sum_err).all()


def test_many_rows_widen_the_weight_in_strips() -> None:
    # From 128 rows the weight is widened to float32 in strips of up to 8 MiB: 4,000 x 576
    # float32 is 9.2 MB, two strips (the second partial), bias added per strip.
    x, w, b = _case(130, 576, 4000, torch.bfloat16, torch.bfloat16, True)
    assert b is not None
    out = wg.widening_gemm(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    scale = float(x.abs().max() * w.abs().max())
    sum_err = 16 * 576**0.5 * torch.finfo(torch.float32).eps * scale
    bound = exact.abs() * torch.finfo(torch.bfloat16).eps + sum_err
    assert out.dtype == torch.bfloat16 and ((out.double() - exact).abs() <= bound).all()


def test_bad_inputs_are_errors() -> None:
    if build.library() is None:
        pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError):
        wg.widening_gemm(x, torch.randn(3, 9).bfloat16(), None)  # inner sizes differ
