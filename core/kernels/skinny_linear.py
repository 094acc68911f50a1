"""Linear layers for a few rows: the compiled CPU kernel and its reference.

A decode step multiplies one row per running request by every weight matrix, so its linears
are a stream over the weights. The GEMM libraries reach a fraction of the memory bandwidth
there, and oneDNN costs ~15 us per call on top (a third of a small layer at one row);
`csrc/skinny_linear.cpp` streams each weight row once per step, prefetching far enough ahead
to run at the machine's read bandwidth, on CPUs with AVX-512:
- float32, up to `MAX_ROWS` rows, with float32 FMAs;
- bfloat16, up to `MAX_ROWS_BF16` rows, on CPUs with AVX512-BF16: pairs multiplied exactly
  and summed in float32 (as oneDNN does), the result rounded to bf16.
Elsewhere (more rows, other dtypes, no AVX-512, `PLUGSERVE_CPU_KERNELS=0`) the packed
GEMM-library path is used. The reference is `F.linear` in float64
(tests/kernels/test_skinny_linear.py).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from plugserve.kernels.build import load_vectorised, vectorised_unavailable_reason

KERNEL = "skinny_linear"
# Rows up to which the kernel beats oneDNN's packed matmul, measured over the default model's
# matrices (576 x 576 .. 49152 x 576) with 2 threads. float32: 0.6x of its time at 1-2 rows,
# 0.8x at 4, 0.93x at 8, 1.2x from 12. bfloat16: 0.6x at 1-2 rows, 0.8x at 4-8, 0.9x at 10-12,
# even at 16. (`python benchmarks/skinny_rows.py` measures it again.)
MAX_ROWS = 8
MAX_ROWS_BF16 = 8


def _kernel() -> ModuleType | None:
    return load_vectorised(KERNEL)


def available() -> bool:
    """True when the kernel is built for this CPU (compiling it the first time)."""
    return _kernel() is not None


def why_unavailable() -> str | None:
    return vectorised_unavailable_reason(KERNEL)


@functools.cache
def takes_bf16() -> bool:
    """True when the built kernel takes bfloat16 operands (the CPU has AVX512-BF16)."""
    module = _kernel()
    return module is not None and bool(module.has_bf16())


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `skinny_linear(x, weight, ...)` is the faster way here."""
    if x.ndim != 2 or not x.is_cpu or not weight.is_cpu:
        return False
    rows, dtype = x.shape[0], x.dtype
    if dtype != weight.dtype or rows == 0:
        return False
    if dtype == torch.float32:
        return rows <= MAX_ROWS and _kernel() is not None
    return dtype == torch.bfloat16 and rows <= MAX_ROWS_BF16 and takes_bf16()


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias) -> [rows, out] in x's dtype (float32, or
    bfloat16 where `takes_bf16()`)."""
    module = _kernel()
    if module is None:
        raise RuntimeError(f"the skinny_linear CPU kernel is unavailable: {why_unavailable()}")
    out: torch.Tensor = module.skinny_linear(x, weight, bias)
    return out


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b).to(x.dtype)
