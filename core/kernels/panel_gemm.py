"""The linear for a few dozen rows: the weight streamed once while the FMAs run.

A decode step over a batch multiplies 9..128 rows by every weight matrix: 2 x rows FLOPs per
weight element read, so the weight stream and the arithmetic take comparable time, and
oneDNN's packed matmul does one after the other. `csrc/kernels/panel_gemm.cpp` packs the
weight once into panels of output columns and fetches the next panel into L2 while the
register tiles multiply the current one by every row, on every ISA the kernels are built
for. Measured with the default model's four matrices per layer, 30 layers' weights cycled
as in an engine step (`python benchmarks/panel_gemm_speed.py`), 2 threads of a Xeon
(avx512): see `MIN_ROWS` / `MAX_ROWS`.

bf16 / fp16 weights on a CPU without native half dot products (AVX2, AVX-512 without
AVX512-BF16) take the same panels in their own dtype, widened to float32 as they are loaded:
half the bytes of float32 and no float32 copy; from 128 rows the widening GEMM's float32
strips take over (`MAX_ROWS_HALF`).

The pack is made once per weight (and again if the weight is written in place), kept while
the weight lives, and is a second copy of it in its dtype (as oneDNN's pack is). The
reference is `F.linear` in float64 (tests/kernels/test_panel_gemm.py).
"""

from __future__ import annotations

import functools

import torch

from plugserve.kernels import build
from plugserve.kernels.packed_linear import HALF, Derived, half_is_native, per_weight

# Rows it takes: from where the few-row kernel stops to where oneDNN's packed matmul catches
# up (benchmarks/panel_gemm_speed.py, float32, weights cold, 2 Xeon threads). avx512_bf16
# copy (48-column panels): per layer of the default model 753 us against oneDNN's 907 at 9
# rows (the few-row kernel: 709), 849 / 1,044 at 16, 1,609 / 2,098 at 64, 2,830 / 3,150 at
# 128, 4,783 / 5,370 at 256; 7,184 / 7,561 at 384, 9,401 / 9,289 at 512 and 19,638 / 18,615
# at 1,024. avx2 copy against oneDNN held to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`, 24-column
# panels): 809 / 1,339 at 9, 2,609 / 3,031 at 64, 4,512 / 4,773 at 128, 8,724 / 8,348 at 256.
MIN_ROWS = 9
MAX_ROWS = 256  # 48-column panels (AVX-512)
MAX_ROWS_NARROW = 128  # narrower panels (AVX2, the scalar copy)
WIDE_PANEL = 48
# bf16 / fp16 panels (CPUs without native half dot products): from 128 rows on, the widening
# GEMM's float32 strips through oneDNN are faster (`plugserve.kernels.widening_gemm`).
MAX_ROWS_HALF = 127

# The packs, per ISA copy in use (each copy's panels have their own width): the copy's name
# -> one pack per weight tensor.
_packs: dict[str, dict[int, Derived]] = {}


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `panel_gemm(x, weight, ...)` is the faster way here: float32, or bf16 / fp16
    on a CPU without native half dot products (panels in the weight's dtype, widened in
    registers), x in the weight's dtype."""
    if x.ndim != 2 or x.dtype != weight.dtype or weight.ndim != 2:
        return False
    if not x.is_cpu or not weight.is_cpu:
        return False
    half = weight.dtype in HALF
    if not half and weight.dtype != torch.float32:
        return False
    rows = x.shape[0]
    if rows < MIN_ROWS or rows > (MAX_ROWS_HALF if half else MAX_ROWS):
        return False
    library = build.library()
    if library is None or (half and half_is_native(weight.dtype)):
        return False
    return rows <= MAX_ROWS_NARROW or _panel_width(library.isa()) >= WIDE_PANEL


@functools.cache
def _panel_width(isa: str) -> int:
    """Output columns per panel in the kernels' copy for `isa`."""
    return int(build.ops().panel_gemm_width())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in the panel layout of the kernels' ISA in use (made once per weight,
    version and ISA)."""
    library = build.library()
    assert library is not None, "panel_gemm needs the CPU kernels (see applies)"
    ops = library.ops
    packed = per_weight(_packs.setdefault(library.isa(), {}), weight,
                        lambda w: ops.panel_gemm_pack(w.detach().contiguous()))
    assert isinstance(packed, torch.Tensor)
    return packed


def panel_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias) -> [rows, out] in x's dtype, summed in
    float32."""
    out: torch.Tensor = build.ops().panel_gemm(x, pack(weight), weight.shape[0], bias)
    return out
