"""The dequantize-matmul kernel (Q8_0, Q4_K, Q6_K) against `plugserve.quant.reference`.

Without CUDA it runs in Triton's CPU interpreter (conftest.py switches it on). Blocks: Q8_0
from `gguf.quants.quantize` of random values; Q4_K and Q6_K random bytes (every byte pattern
is a valid block) with their fp16 scales set to finite values, as `gguf` cannot quantize
K-quants. The reference is `gguf.quants.dequantize`.
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
import torch

from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import dequantize
from plugserve.quant.types import quant_type
from plugserve_attention_triton.kernels.quant_matmul import (
    check_operands,
    quant_matmul,
    quant_matmul_launch,
)

# fp16 fields of each block: byte offset -> (low, high) magnitude of the random values.
_SCALE_FIELDS = {"q4_k": {0: (1e-3, 2e-2), 2: (1e-3, 2e-2)}, "q6_k": {208: (1e-3, 2e-2)}}


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> QuantBlocks:
    kind = quant_type(qtype)
    rng = np.random.default_rng(seed)
    if qtype == "q8_0":
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        data = gguf.quants.quantize(values, kind.ggml)
    else:
        data = rng.integers(0, 256, (rows, kind.row_bytes(cols)), dtype=np.uint8)
        blocks = data.reshape(rows, -1, kind.block_bytes)
        for offset, (low, high) in _SCALE_FIELDS[qtype].items():
            scale = rng.uniform(low, high, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])
            blocks[:, :, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(
                *blocks.shape[:2], 2)
    return QuantBlocks(kind, torch.from_numpy(np.ascontiguousarray(data)), rows, cols)


def magnitude_tolerance(dtype: torch.dtype) -> float:
    """Error allowed relative to sum |x| |w| over K: fp32 summation order; half types one
    rounding of the output (the weights are rounded to x's dtype in the reference too)."""
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize("qtype,cols", [("q8_0", 96), ("q8_0", 256), ("q4_k", 512),
                                        ("q6_k", 512), ("q4_k", 256), ("q6_k", 256)])
@pytest.mark.parametrize("rows", [1, 3, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_reference(qtype: str, cols: int, rows: int, dtype: torch.dtype,
                               kernel_device: torch.device) -> None:
    out_features = 37  # not a multiple of any tile
    seed = zlib.crc32(f"{qtype} {cols} {rows} {dtype}".encode())
    w = random_blocks(qtype, out_features, cols, seed)
    torch.manual_seed(seed)
    x = torch.randn(rows, cols).to(dtype)
    got = quant_matmul(x.to(kernel_device), QuantBlocks(
        w.qtype, w.data.to(kernel_device), w.rows, w.cols)).cpu()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    weights = dequantize(w)
    want = x.float() @ weights.to(dtype).float().T  # what the kernel multiplies, exactly
    bound = x.float().abs() @ weights.abs().T
    error = (got.float() - want).abs()
    assert torch.all(error <= magnitude_tolerance(dtype) * bound + 1e-6), error.max()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
def test_one_hot_rows_read_back_the_dequantized_weights(qtype: str,
                                                        kernel_device: torch.device) -> None:
    """x = rows of the identity: the product is exactly dequantize(W)'s columns (fp32)."""
    cols = 256
    w = random_blocks(qtype, 19, cols, seed=7)
    picked = [0, 1, 31, 32, 63, 64, 100, 127, 128, 129, 191, 192, 255]
    x = torch.eye(cols)[picked]
    got = quant_matmul(x.to(kernel_device), QuantBlocks(
        w.qtype, w.data.to(kernel_device), w.rows, w.cols)).cpu()
    torch.testing.assert_close(got, dequantize(w)[:, picked].T, rtol=0, atol=0)


def test_leading_dimensions_are_kept(kernel_device: torch.device) -> None:
    w = random_blocks("q8_0", 8, 64, seed=3)
    x = torch.randn(2, 3, 64)
    got = quant_matmul(x.to(kernel_device), QuantBlocks(
        w.qtype, w.data.to(kernel_device), w.rows, w.cols)).cpu()
    assert got.shape == (2, 3, 8)
    torch.testing.assert_close(got, x @ dequantize(w).T, rtol=1e-5, atol=1e-5)


def test_operands_that_do_not_fit_are_named() -> None:
    w = random_blocks("q8_0", 4, 64, seed=1)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="reads q8_0, q4_k, q6_k blocks, not 'q4_0'"):
        check_operands(x, w.data, "q4_0", 4, 64)
    with pytest.raises(ValueError, match="q4_k: K=64 is not a multiple of its block of 256"):
        check_operands(x, w.data, "q4_k", 4, 64)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] with contiguous rows, got "
                                         r"\[64, 2\]"):
        check_operands(x.T, w.data, "q8_0", 4, 64)
    with pytest.raises(ValueError, match=r"x must be float16, bfloat16 or float32, got "
                                         r"torch\.float64"):
        check_operands(x.double(), w.data, "q8_0", 4, 64)
    with pytest.raises(ValueError, match=r"q8_0 blocks of a \[5, 64\] matrix must be "
                                         r"contiguous uint8 \[5, 68\], got torch.uint8 \[4, 68\]"):
        check_operands(x, w.data, "q8_0", 5, 64)


def test_cuda_tiles_feed_the_tensor_cores() -> None:
    """The CUDA launches' tiles: at least 16 in every dot dimension, K slices of whole
    32-weight blocks, fp32 without the interpreter's upcast."""
    w = random_blocks("q6_k", 64, 256, seed=2)
    for rows in (1, 16, 17, 300):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.zeros(rows, 256, dtype=dtype)
            out = torch.empty(rows, 64, dtype=dtype)
            launch = quant_matmul_launch(x, w.data, "q6_k", 64, 256, out, arch=90)
            options = launch.options
            assert min(options["BLOCK_M"], options["BLOCK_N"], options["BLOCK_K"]) >= 16
            assert options["BLOCK_K"] % 32 == 0 and options["DOT_IN_FP32"] is False
            assert launch.grid == (-(-rows // options["BLOCK_M"]), -(-64 // options["BLOCK_N"]))
