"""The GEMM for bf16 / fp16 weights on CPUs without native half dot products.

oneDNN's bf16 matmul is 5-10x slower than its float32 one on a CPU without AVX512-BF16 or
AMX, so such a model used to multiply against a float32 copy of every weight, twice the
memory and twice the bytes a step reads. `csrc/kernels/skinny_linear.cpp` instead reads the
weight in its own dtype, widens it in registers (a 16-bit shift for bf16) and multiplies in
float32 with the few-row kernel's register tiles, over blocks of 128 rows of x (widened to
float32 once). From 128 rows of x on (a prefill) the float32 GEMM is faster even counting
the widening: the weight is widened to float32 a strip of up to 8 MiB at a time (usually
whole) into one reused buffer, read once for all the rows, and multiplied there (1.3-1.8x the
register kernel on a 2-core Xeon with AVX-512 and no AVX512-BF16, `--dtype bfloat16`
prefill); no float32 copy of the weights is kept. The output has x's dtype, rounded once.
The reference is `F.linear` in float64 (tests/kernels/test_widening_gemm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugserve.kernels import build
from plugserve.kernels.packed_linear import HALF, half_is_native


def takes(weight: torch.Tensor) -> bool:
    """True for a half-precision CPU weight this CPU does not multiply natively, when the
    kernels are built."""
    return (
        weight.dtype in HALF and weight.is_cpu and weight.ndim == 2
        and not half_is_native(weight.dtype) and build.library() is not None
    )


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `widening_gemm(x, weight, ...)` is the way to multiply these here."""
    return x.is_cpu and x.ndim == 2 and takes(weight)


def widening_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] (float32, bf16 or fp16) @ weight [out, in].T (bf16 or fp16) (+ bias) ->
    [rows, out] in x's dtype, summed in float32."""
    out: torch.Tensor = build.ops().widening_gemm(x, weight, bias)
    return out


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b).to(x.dtype)
