"""Linear layers for a few rows: the compiled CPU kernel and its reference.

A decode step multiplies one row per running request by every weight matrix, so its linears
are a stream over the weights. The GEMM libraries reach a fraction of the memory bandwidth
there, and oneDNN costs ~15 us per call on top (a third of a small layer at one row);
`csrc/kernels/skinny_linear.cpp` streams each weight row once per step, prefetching far
enough ahead to run at the machine's read bandwidth, on every ISA the kernels are built for:
- float32, up to `MAX_ROWS` rows, with float32 FMAs;
- bfloat16, up to `MAX_ROWS_BF16` rows: the weight read as bf16 (half the bytes of float32)
  and widened in registers, summed in float32 and rounded to bf16 once; on CPUs with
  AVX512-BF16 with vdpbf16ps (pairs multiplied exactly and summed in float32, as oneDNN
  does).
Elsewhere (more rows, other dtypes, `PLUGSERVE_CPU_KERNELS=0`) the GEMM paths of
`plugserve.model.layers.linear` are used. The reference is `F.linear` in float64
(tests/kernels/test_skinny_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugserve.kernels import build

# Rows up to which the kernel beats oneDNN's packed matmul, measured over the default model's
# matrices (576 x 576 .. 49152 x 576) with 2 threads. float32: 0.6x of its time at 1-2 rows,
# 0.8x at 4, 0.93x at 8, 1.2x from 12. bfloat16: 0.6x at 1-2 rows, 0.8x at 4-8, 0.9x at 10-12,
# even at 16. (`python benchmarks/skinny_rows.py` measures it again.)
MAX_ROWS = 8
MAX_ROWS_BF16 = 8


def available() -> bool:
    """True when the kernel is built for this CPU (compiling it the first time)."""
    return build.library() is not None


def why_unavailable() -> str | None:
    return build.unavailable_reason()


def takes_bf16() -> bool:
    """True when the kernel takes bfloat16 operands: wherever it is built (natively with
    AVX512-BF16, widened to float32 in registers elsewhere)."""
    return available()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `skinny_linear(x, weight, ...)` is the faster way here."""
    if x.ndim != 2 or not x.is_cpu or not weight.is_cpu:
        return False
    rows, dtype = x.shape[0], x.dtype
    if dtype != weight.dtype or rows == 0:
        return False
    if dtype == torch.float32:
        return rows <= MAX_ROWS and build.library() is not None
    return dtype == torch.bfloat16 and rows <= MAX_ROWS_BF16 and build.library() is not None


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias) -> [rows, out] in x's dtype (float32 or
    bfloat16)."""
    out: torch.Tensor = build.ops().skinny_linear(x, weight, bias)
    return out


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b).to(x.dtype)
