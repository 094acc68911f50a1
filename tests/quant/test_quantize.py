"""Quantization on load: Q8_0 / Q4_0 as gguf writes them, Q4_K (our numpy port of llama.cpp's
make_qkx2_quants) decoded by `gguf.quants.dequantize` within one quantization step."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from plugserve.quant.quantize import quantize
from plugserve.quant.reference import dequantize


def _weights(rows: int, cols: int, kind: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(rows, cols, generator=gen)
    return torch.rand(rows, cols, generator=gen) + 0.5


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_q8_0_and_q4_0_are_the_blocks_gguf_writes(name: str) -> None:
    w = _weights(5, 96, "normal")
    blocks = quantize(w, name)
    expected = gguf.quants.quantize(w.numpy(), blocks.qtype.ggml)
    assert blocks.rows == 5 and blocks.cols == 96
    assert np.array_equal(blocks.data.numpy(), expected)


@pytest.mark.parametrize("kind", ["normal", "positive"])
@pytest.mark.parametrize("rows", [1, 7])
def test_q4_k_round_trip_stays_within_one_step_per_sub_block(kind: str, rows: int) -> None:
    w = _weights(rows, 512, kind, seed=rows)
    blocks = quantize(w, "q4_k")
    assert tuple(blocks.data.shape) == (rows, 2 * 144)
    back = dequantize(blocks)
    sub, got = w.reshape(-1, 32), back.reshape(-1, 32)
    # one 4-bit step of a sub-block: its range (min clamped to 0) over 15 levels
    step = (sub.amax(1) - sub.amin(1).clamp(max=0)) / 15
    assert ((sub - got).abs().amax(1) <= step * 1.0 + 1e-6).all()
    rel = ((back - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    q4_0 = dequantize(quantize(w, "q4_0"))
    rel_q4_0 = ((q4_0 - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    assert rel < rel_q4_0  # the K-quant fit beats Q4_0's per-block absmax
    assert rel < 0.08


def test_q4_k_flat_blocks_decode_exactly() -> None:
    w = torch.zeros(3, 256)
    w[1] = -0.75  # a constant negative block: its min alone carries it
    w[2, :32] = 1.0  # one non-zero sub-block
    back = dequantize(quantize(w, "q4_k"))
    assert torch.equal(back[0], w[0])
    torch.testing.assert_close(back[1], w[1], rtol=0, atol=1e-3)
    torch.testing.assert_close(back[2], w[2], rtol=0, atol=1e-3)


def test_columns_not_a_multiple_of_the_block_are_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        quantize(torch.zeros(2, 96), "q4_k")
    with pytest.raises(ValueError, match="allowed"):
        quantize(torch.zeros(2, 96), "q3_k")
