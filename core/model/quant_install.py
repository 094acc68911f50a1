"""Putting quantized tensors into a model: the loaders collect each parameter's row blocks
(`QuantParts`) while they stream the file, then `install_quantized` hands every fully
quantized parameter to its layer (`WeightHolder.hold_quantized`).

A parameter that received dense rows too (a fused q/k/v whose v is stored as F16, say) is
kept dense: its quantized rows are dequantized into it. Rows past the last part (the zero
padding of the last tensor-parallel rank's vocabulary) are zero blocks, which every GGML
format decodes to 0.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from plugserve.model.llama import CausalLM
from plugserve.model.quant_weight import WeightHolder
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations, dequantize


def quant_shape(tensor: torch.Tensor | QuantBlocks) -> tuple[int, ...]:
    """The shape of the matrix a tensor or a block-quantized tensor stands for."""
    if isinstance(tensor, QuantBlocks):
        return (tensor.rows, tensor.cols)
    return tuple(tensor.shape)


class QuantParts:
    """Parameter name -> its quantized row blocks (row_start, blocks), as they arrive."""

    def __init__(self) -> None:
        self.parts: dict[str, list[tuple[int, QuantBlocks]]] = defaultdict(list)

    def add(self, param: str, row_start: int, blocks: QuantBlocks) -> None:
        self.parts[param].append((row_start, blocks))


def _zero_blocks(like: QuantBlocks, rows: int) -> QuantBlocks:
    data = torch.zeros(rows, like.data.shape[1], dtype=torch.uint8)
    return QuantBlocks(like.qtype, data, rows, like.cols)


def _stacked(param: str, parts: list[tuple[int, QuantBlocks]], rows: int
             ) -> list[QuantBlocks] | None:
    """The parts in row order, zero-padded at the tail; None when other rows are dense."""
    ordered = sorted(parts, key=lambda p: p[0])
    out: list[QuantBlocks] = []
    row = 0
    for start, blocks in ordered:
        if start != row:
            return None
        out.append(blocks)
        row += blocks.rows
    if row < rows:
        if not param.endswith(("embed_tokens.weight", "lm_head.weight")):
            return None
        out.append(_zero_blocks(out[-1], rows - row))
    return out


def install_quantized(model: CausalLM, pending: QuantParts, activations: Activations) -> None:
    """Every collected parameter held quantized by its layer (or dequantized into place)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, parts in pending.parts.items():
            param = params[name]
            layer = model.get_submodule(name.rsplit(".", 1)[0])
            stacked = _stacked(name, parts, param.shape[0])
            if stacked is not None and isinstance(layer, WeightHolder) and name.endswith(
                    ".weight"):
                layer.hold_quantized(stacked, activations)
                continue
            for start, blocks in parts:
                param[start : start + blocks.rows].copy_(dequantize(blocks, param.dtype))
