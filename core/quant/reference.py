"""Pure-torch references for the quantized kernels, built on `gguf.quants` (numpy).

`dequantize` is the ground truth of every format. `quantize_activations_int8` is what the
int8-activation path does to its input (llama.cpp's Q8_0 for activations: per 32-weight
block, scale = max|x| / 127, round to nearest), so `reference_linear(..., activations="int8")`
is the value a kernel with integer dot products must reproduce up to fp32 summation order.
"""

from __future__ import annotations

from typing import Literal

import gguf
import numpy as np
import torch

from plugserve.quant.blocks import QuantBlocks

Activations = Literal["int8", "float"]
ACTIVATION_BLOCK = 32


def dequantize(w: QuantBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [rows, cols] matrix the blocks encode."""
    raw = w.data.contiguous().numpy()
    values = gguf.quants.dequantize(raw, w.qtype.ggml)
    out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return out.reshape(w.rows, w.cols).to(dtype)


def dequantize_rows(w: QuantBlocks, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Only the rows `ids` (any shape) dequantized: an embedding lookup."""
    flat = ids.reshape(-1).to(torch.long).cpu()
    picked = QuantBlocks(w.qtype, w.data.index_select(0, flat), flat.numel(), w.cols)
    return dequantize(picked, dtype).reshape(*ids.shape, w.cols)


def quantize_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., cols] rounded through int8 per 32-element block (returned as float32)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round()
    scale16 = scale.to(torch.float16).float()  # llama.cpp stores the scale as fp16
    return (q * scale16).reshape(x.shape)


def reference_linear(
    x: torch.Tensor, w: QuantBlocks, bias: torch.Tensor | None = None,
    activations: Activations = "float",
) -> torch.Tensor:
    """x @ dequantize(w).T (+ bias) in float32, returned in x's dtype."""
    xf = quantize_activations_int8(x) if activations == "int8" else x.float()
    out = xf @ dequantize(w).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
