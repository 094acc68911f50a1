"""Tile sizes and launch options per target (plain Python, no Triton import).

`arch` is the CUDA compute capability the kernel is compiled for (80 = sm_80), or None for
Triton's CPU interpreter, where fewer, larger tiles are faster and the launch options mean
nothing. `tl.dot` needs every dimension to be at least 16 when compiled, so tiles never go
below that. Every CUDA choice here is compiled for sm_80 and sm_90 by the CUDA compile check
(`tests/cuda_compile_check.py`), which fails on register spills and on shared memory above
the architecture's limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2_E = math.log2(math.e)  # softmax runs in base 2: exp(x) == exp2(x * LOG2_E)
MIN_DOT_DIM = 16


def pow2_at_least(value: int, floor: int = 1) -> int:
    """Smallest power of two >= max(value, floor)."""
    target = max(value, floor, 1)
    return 1 << (target - 1).bit_length()


@dataclass(frozen=True)
class Tiles:
    block_m: int  # queries per program (extend); unused by decode
    block_n: int  # keys per tile
    num_warps: int = 4
    num_stages: int = 2

    def launch_options(self) -> dict[str, object]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


_INTERPRETER_EXTEND = Tiles(block_m=32, block_n=32)
_INTERPRETER_DECODE = Tiles(block_m=0, block_n=32)


# CUDA tiles, by padded head size. The same for sm_80 and sm_90: the compile check's table
# (plugin README) shows each without register spills and with shared memory under 99 KiB, so
# they also fit the smaller sm_86/sm_89 parts. Half types: 64 queries x 64 keys feed the
# tensor cores, 8 warps from d128 keep the fp32 accumulator in registers; at d256 a tree
# mask's tile spills a 64-query block on sm_80, so 32 queries x 64 keys.
_HALF_EXTEND = {64: Tiles(64, 64, num_warps=4), 128: Tiles(64, 64, num_warps=8),
                256: Tiles(32, 64, num_warps=8)}
# fp32 multiplies on the FMA units (no tf32: see extend.py), whose operands live in registers:
# smaller tiles over 8 warps.
_FP32_EXTEND = {64: Tiles(32, 32, num_warps=8), 128: Tiles(32, 16, num_warps=8),
                256: Tiles(32, 16, num_warps=8)}
_HALF_DECODE = {64: Tiles(0, 64), 128: Tiles(0, 64), 256: Tiles(0, 32)}
_FP32_DECODE = {64: Tiles(0, 32, num_warps=8), 128: Tiles(0, 32, num_warps=8),
                256: Tiles(0, 32, num_warps=8)}


def _by_head_dim(table: dict[int, Tiles], block_d: int) -> Tiles:
    """The entry for the smallest listed head size >= block_d (the widest for wider heads)."""
    fitting = [d for d in sorted(table) if d >= block_d]
    return table[fitting[0] if fitting else max(table)]


def extend_tiles(arch: int | None, dtype: torch.dtype, block_d: int) -> Tiles:
    """Tiles and launch options of the extend kernel."""
    if arch is None:
        return _INTERPRETER_EXTEND
    return _by_head_dim(_FP32_EXTEND if dtype == torch.float32 else _HALF_EXTEND, block_d)


def decode_tiles(arch: int | None, dtype: torch.dtype, block_d: int) -> Tiles:
    """Keys per tile and launch options of the split-KV decode kernel."""
    if arch is None:
        return _INTERPRETER_DECODE
    return _by_head_dim(_FP32_DECODE if dtype == torch.float32 else _HALF_DECODE, block_d)


def decode_head_tile(heads_per_kv_head: int) -> int:
    """Query heads handled together by one decode program (one KV head's group, padded)."""
    return pow2_at_least(heads_per_kv_head, MIN_DOT_DIM)


def dot_in_fp32(arch: int | None, dtype: torch.dtype) -> bool:
    """Whether the kernels upcast bf16 dot operands to fp32: only in Triton's CPU
    interpreter, which stores bf16 as raw 16-bit integers and whose `tl.dot` multiplies those
    bits (triton-lang/triton#11584; its docs: cast bf16 to fp32 there). Rounded values stay
    rounded, so the interpreter computes what the tensor cores compute, up to summation
    order."""
    return arch is None and dtype == torch.bfloat16
