"""Linear layers over block-quantized weights (`plugserve.quant.blocks.QuantBlocks`).

`quant_linear(x, w, bias, activations)` is the one entry the model's layers call for a
quantized weight. `activations="float"` keeps x in its dtype (the result equals x @
dequantize(w).T up to summation order); `"int8"` rounds x through int8 per 32-block first,
as llama.cpp does, so integer dot products can be used.

Two compiled paths, chosen by the rows of x:
- up to `MAX_FEW_ROWS` rows (decode; `csrc/kernels/quant_linear.cpp`): the blocks stream once
  per call and are decoded in registers and L1; int8 activations multiply with integer dot
  products (AVX512-VNNI, or AVX-512BW / AVX2 `maddubs`), float activations with the blocks
  widened to float32;
- more rows (prefill, batched decode; `ops.quant_gemm`): with int8 activations (any x) or
  bf16 x, x is rounded through int8 per 32-block first for int8 activations, then: on AMX
  tiles where `amx_available()` (`csrc/kernels/quant_amx.cpp`: a bf16 product with float32
  sums; strips of 32 weight rows dequantized into the B tiles' layout, reused across all rows
  of x; past 256 rows the whole weight first, then panels of x against it, the dense AMX
  kernel's prefill order), and for a prefill's rows against a weight of more than 2 MiB in
  bf16 (where oneDNN's GEMM is the faster, as for the dense weights) the path below; without
  AMX, int8 activations go to the VNNI kernel where the CPU has AVX512-VNNI
  (`csrc/kernels/quant_vnni.cpp`: x's int8 quants against the weight's bytes with vpdpbusd,
  exact integer sums per weight group, float32 sums of their scaled values), else on the
  `avx2` copy to the AVX2 kernel (`csrc/kernels/quant_maddubs.cpp`: the same sums, to the
  bit, with vpmaddubsw, the pairwise int16 products added over as many steps as cannot
  overflow; Q8_0 up to 128 rows); elsewhere (Q8_0 past 128 rows on AVX2, an AVX-512 copy
  without VNNI, the scalar copy, float activations of a bf16 x) the matrix
  dequantized in strips of up to `STRIP_BYTES` (usually whole) and one dense GEMM per strip
  written in place into the output: in bf16 where the kernel copy in use multiplies bf16
  natively (`avx512_bf16`), in float32 elsewhere (oneDNN's bf16 GEMM is 5-10x slower than its
  float32 one on a CPU without AVX512-BF16); the result in x's dtype. Float activations with
  float32 x stay float32: strips of float32 weights through the float32 GEMM (x @
  dequantize(w).T up to summation order).
Without the compiled kernels (`PLUGSERVE_CPU_KERNELS=0`, no compiler) the pure-torch
reference runs.
"""

from __future__ import annotations

import torch

from plugserve.kernels import build
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations, reference_linear

# Rows of x up to which the streaming kernel runs, past which the tiled GEMM does: the dense
# few-row kernel's limit (skinny_linear.MAX_ROWS), not yet measured for the quantized kernels
# (`benchmarks/quant_linear_speed.py --rows R` times the streaming kernel at R rows).
MAX_FEW_ROWS = 8
# Bytes of dequantized weight per strip of the dequantize-and-GEMM path (whole rows, a
# multiple of 16, at least 16): up to this much, the whole matrix is dequantized and
# multiplied by one GEMM call (fewer, larger GEMMs run faster than tiles that fit L2: see the
# module doc); larger matrices (a vocabulary's head) go in strips of this size.
STRIP_BYTES = 8 << 20
ACTIVATIONS = ("int8", "float")
# The many-row path's kernel choices (`many_rows`): "auto" as the entry chooses, "vnni" the
# VNNI kernel where it runs (skipping AMX), "maddubs" the AVX2 integer kernel where the copy
# has AVX2 (skipping AMX and VNNI), "strips" the dequantize-and-GEMM path only.
MANY_ROW_KERNELS = ("auto", "vnni", "maddubs", "strips")


def available() -> bool:
    """True when the compiled kernels are built for this CPU (compiling them the first time)."""
    return build.library() is not None


def amx_available() -> bool:
    """Whether the many-row path runs on AMX tiles here (the CPU has AMX-BF16, the OS lets
    this process use the tile state, and the kernels were compiled with AMX)."""
    return available() and bool(build.ops().quant_amx_usable())


def vnni_available() -> bool:
    """Whether int8 activations of many rows multiply on the VNNI kernel here (an AVX-512
    copy of the kernels on a CPU with AVX512-VNNI), where AMX does not take them."""
    return available() and bool(build.ops().quant_vnni_usable())


def maddubs_available() -> bool:
    """Whether int8 activations of many rows can multiply on the AVX2 integer kernel here
    (vpmaddubsw; any copy with AVX2), where AMX and VNNI do not take them."""
    return available() and bool(build.ops().quant_maddubs_usable())


def quant_linear(
    x: torch.Tensor, w: QuantBlocks, bias: torch.Tensor | None = None,
    activations: Activations = "int8",
) -> torch.Tensor:
    """x [..., w.cols] -> [..., w.rows] in x's dtype."""
    if x.shape[-1] != w.cols:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {w.cols}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}; allowed: {', '.join(ACTIVATIONS)}")
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or not available():
        return reference_linear(x, w, bias, activations)
    flat = x if x.dim() == 2 else x.reshape(-1, w.cols)
    ops = build.ops()
    int8 = activations == "int8"
    if flat.shape[0] <= MAX_FEW_ROWS:
        out = ops.quant_linear(flat, w.data, w.qtype.name, bias, int8)
    else:
        out = ops.quant_gemm(flat, w.data, w.qtype.name, bias, int8, STRIP_BYTES, "auto")
    result: torch.Tensor = out if x.dim() == 2 else out.reshape(*x.shape[:-1], w.rows)
    return result


def few_rows(
    x: torch.Tensor, w: QuantBlocks, bias: torch.Tensor | None, activations: Activations,
) -> torch.Tensor:
    """The streaming kernel for any number of rows of x [rows, cols] (tests, benchmarks)."""
    out: torch.Tensor = build.ops().quant_linear(
        x, w.data, w.qtype.name, bias, activations == "int8"
    )
    return out


def many_rows(
    x: torch.Tensor, w: QuantBlocks, bias: torch.Tensor | None, activations: Activations,
    kernels: str = "auto",
) -> torch.Tensor:
    """The many-row path for any number of rows of x [rows, cols]; `kernels` (one of
    MANY_ROW_KERNELS) "vnni" keeps it off AMX, "maddubs" off AMX and VNNI, "strips" off all
    three (the dequantize-and-GEMM path, as on a CPU with none of them)."""
    if kernels not in MANY_ROW_KERNELS:
        raise ValueError(f"kernels={kernels!r}; allowed: {', '.join(MANY_ROW_KERNELS)}")
    out: torch.Tensor = build.ops().quant_gemm(
        x, w.data, w.qtype.name, bias, activations == "int8", STRIP_BYTES, kernels
    )
    return out


def dequantize(w: QuantBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [rows, cols] matrix the blocks encode, by the compiled decoder."""
    out: torch.Tensor = build.ops().quant_dequantize(w.data, w.qtype.name, w.cols, dtype)
    return out
