"""Tile sizes and constants shared by the kernels (plain Python, no Triton import).

`tl.dot` needs every dimension to be at least 16 when compiled, so tiles never go below
that. The CPU interpreter runs each program in Python, where fewer, larger tiles are faster.
"""

from __future__ import annotations

import math

import torch

LOG2_E = math.log2(math.e)  # softmax runs in base 2: exp(x) == exp2(x * LOG2_E)
MIN_DOT_DIM = 16


def pow2_at_least(value: int, floor: int = 1) -> int:
    """Smallest power of two >= max(value, floor)."""
    target = max(value, floor, 1)
    return 1 << (target - 1).bit_length()


# Above this padded head size, CUDA tiles take half the keys so that the fp32 K/V tiles of
# the software pipeline stay inside an A100's shared memory.
WIDE_HEAD_DIM = 128


def extend_tiles(device: torch.device, block_d: int) -> tuple[int, int]:
    """(queries, keys) per extend tile."""
    if device.type == "cuda":
        return 32, (64 if block_d <= WIDE_HEAD_DIM else 32)
    return 32, 32


def decode_key_tile(device: torch.device, block_d: int) -> int:
    """Keys per decode tile."""
    if device.type == "cuda":
        return 64 if block_d <= WIDE_HEAD_DIM else 32
    return 32


def decode_head_tile(heads_per_kv_head: int) -> int:
    """Query heads handled together by one decode program (one KV head's group, padded)."""
    return pow2_at_least(heads_per_kv_head, MIN_DOT_DIM)
