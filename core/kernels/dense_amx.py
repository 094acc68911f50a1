"""The dense bf16 linear on AMX tiles for a decode batch's rows and, where the weight is
small, a prefill's (`csrc/kernels/dense_amx.cpp`).

At 9 .. ~100 rows a bf16 linear is a stream over its weight, and oneDNN's packed matmul
(`plugserve.kernels.packed_linear`) neither overlaps that stream with its AMX products nor
reaches the memory bandwidth there. This kernel reads a weight packed once into the layout
the tiles consume (strips of 32 rows, each one contiguous run of 16 x 32 tiles in VNNI
pairs), each thread a contiguous run of strips, prefetching the next strips into L2 while
the tiles multiply the current one; float32 sums, the output (+ bias) rounded to bf16 once.

It runs where the CPU has AMX-BF16, the OS grants this process the tile state and the
kernels' `avx512_bf16` copy is in use with the AMX flags (`amx_usable()`), for bf16 x and
weight with `MIN_ROWS` .. `MAX_ROWS` rows (`applies`) or up to `PANEL_MAX_ROWS` rows and a
weight of at most `PANEL_MAX_WEIGHT_BYTES` (`applies_many`), and input features a multiple
of 32; everywhere else (`PLUGSERVE_DENSE_AMX=0` too) `plugserve.model.layers.linear` keeps
oneDNN. The pack
is cached per weight tensor and rebuilt when the weight is written in place. The reference
is `F.linear` in float64 (tests/kernels/test_dense_amx.py); `benchmarks/dense_amx_speed.py`
measures it against oneDNN.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from plugserve.kernels import build, skinny_linear
from plugserve.kernels.packed_linear import Derived, per_weight

ENV_SWITCH = "PLUGSERVE_DENSE_AMX"
STRIP_ROWS = 32  # weight rows per strip: two 16-row tiles
TILE_K = 32  # input features per tile (16 bf16 pairs)
# Fewer rows go to the streaming kernel (plugserve.kernels.skinny_linear).
MIN_ROWS = skinny_linear.MAX_ROWS_BF16 + 1
# Rows up to which the kernel beats oneDNN at the default model's layers, weights cold
# (`python benchmarks/dense_amx_speed.py`, 2 threads): oneDNN's time / the kernel's 1.2-1.4
# at 9-32 rows (memory speed), 1.03-1.15 at 48-96 (each 32-row block of x is a pass over the
# strip from L2), 0.9-1.05 at 128 (0.94-0.95 measured again 2026-11-27), 0.8 at 256.
MAX_ROWS = 96
# Past MAX_ROWS (a prefill chunk) the kernel cuts x into panels of rows, each thread
# multiplying its panels by the whole weight (`csrc/kernels/dense_amx.cpp`: panel_gemm): the
# faster order while the weight stays in a core's L2 between panels (2 MiB per core on the
# CPUs measured) and the rows are few enough that the panels' outputs do not push it out.
# Measured (2-core Xeon, 2 threads; `python benchmarks/dense_amx_speed.py --prefill` and
# whole bf16 prefills of the default model): oneDNN's packed matmul runs the small matrices
# at 1.1-3.1 TFLOP/s, often about one thread's rate (its split of such a shape over 2
# threads leaves one mostly idle), the kernel at 1.5-2.9; prefills of 256 / 512 / 1,024
# tokens took 0.87-0.94x / 0.90x / 0.85x the time with the kernel, 2,048 tokens 1.07x (so
# not past PANEL_MAX_ROWS). A larger weight (the gate-up projection) keeps oneDNN, which
# ran it at 2.3-3.3 against the kernel's 1.2-2.2.
PANEL_MAX_ROWS = 1024
PANEL_MAX_WEIGHT_BYTES = 2 * 1024 * 1024


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


_ENABLED = enabled_by_environment()
_usable: tuple[int, bool] = (-1, False)  # (the library's ISA generation, the answer)


def amx_usable() -> bool:
    """Whether the AMX kernels run here: the CPU has AMX-BF16, the OS grants the tile state,
    and the kernels' copy in use was compiled with AMX (asked again when the ISA changes)."""
    global _usable
    library = build.library()
    if library is None:
        return False
    if _usable[0] != library.generation:
        _usable = (library.generation, bool(library.ops.amx_usable()))
    return _usable[1]


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `dense_amx_linear(x, weight, ...)` is the faster way here for a decode
    batch's rows (`MIN_ROWS` .. `MAX_ROWS`: the rows the compiled decode stack takes)."""
    return MIN_ROWS <= x.shape[0] <= MAX_ROWS and _operands_fit(x, weight)


def applies_many(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `dense_amx_linear` is the faster way for more than `MAX_ROWS` rows (a
    prefill chunk, up to `PANEL_MAX_ROWS`): a weight of at most `PANEL_MAX_WEIGHT_BYTES`."""
    return (
        x.ndim == 2
        and MAX_ROWS < x.shape[0] <= PANEL_MAX_ROWS
        and weight.numel() * weight.element_size() <= PANEL_MAX_WEIGHT_BYTES
        and _operands_fit(x, weight)
    )


def _operands_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _ENABLED
        and x.ndim == 2
        and weight.ndim == 2
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % TILE_K == 0
        and weight.shape[1] > 0
        and x.is_cpu
        and weight.is_cpu
        and amx_usable()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (K a multiple of 32) as the kernel reads it: rows padded with zeros to
    strips of 32, each strip K / 32 steps of two tiles (its rows 0-15, then 16-31), tile row
    p holding pair (2p, 2p + 1) of the step's 32 columns for each of the 16 weight rows."""
    n, k = weight.shape
    if k % TILE_K != 0:
        raise ValueError(f"dense_amx: {k} input features is not a multiple of {TILE_K}")
    strips = -(-n // STRIP_ROWS)
    padded = weight.detach().new_zeros(strips * STRIP_ROWS, k)
    padded[:n] = weight.detach()
    # (strip, half, row, step, pair, element) -> (strip, step, half, pair, row, element)
    tiles = padded.view(strips, 2, 16, k // TILE_K, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.contiguous()


_packs: dict[int, Derived] = {}


def packed(weight: torch.Tensor) -> torch.Tensor:
    """The cached pack of `weight` (see `pack`), rebuilt when the weight is written."""
    value = per_weight(_packs, weight, pack)
    assert isinstance(value, torch.Tensor)
    return value


def dense_amx_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias) -> [rows, out], all bfloat16 (where
    `applies`)."""
    out: torch.Tensor = build.ops().dense_amx_linear(x, packed(weight), weight.shape[0], bias)
    return out


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b).to(x.dtype)
