"""The one place where a layer's weight is either dense or block-quantized.

A layer that owns a [rows, cols] matrix (`Linear`, `Embedding` and their tensor-parallel
forms) derives from `WeightHolder`. Its `weight` parameter is the dense matrix, or, once
`hold_quantized` was called, a placeholder on the "meta" device (the shape and dtype without
storage, so code that reads only `.weight.shape` keeps working and code that would read its
values fails loudly) while `quant` holds the blocks: one or more `QuantBlocks` stacked along
the rows (a fused projection whose parts the file stores in different types, e.g. q/k in
Q4_K and v in Q6_K, keeps each run of one type as it is). `linear_any` multiplies either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plugserve.kernels import quant_linear as compiled
from plugserve.kernels.quant_linear import quant_linear
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations, dequantize, dequantize_rows

QuantWeight = tuple[QuantBlocks, ...]

# Formats whose rows an embedding lookup dequantizes with the compiled decoder: it gives the
# reference's values bit for bit there (Q8_0: d * q, one float32 product, as gguf computes
# it) in a tenth of the time (~15 us against ~150 us a decode step, the tied embeddings of
# the SmolLM2 GGUF files); the others keep the reference (their sums may round apart).
EXACT_COMPILED_ROWS = frozenset({"q8_0"})
LinearWeight = torch.Tensor | QuantWeight


def merged_parts(parts: list[QuantBlocks]) -> QuantWeight:
    """Adjacent row blocks of one type joined into one (a copy); others kept apart."""
    out: list[QuantBlocks] = []
    for part in parts:
        last = out[-1] if out else None
        if last is not None and last.qtype == part.qtype and last.cols == part.cols:
            data = torch.cat((last.data, part.data))
            out[-1] = QuantBlocks(part.qtype, data, last.rows + part.rows, part.cols)
        else:
            out.append(part)
    return tuple(out)


def quant_matmul(
    x: torch.Tensor, parts: QuantWeight, bias: torch.Tensor | None, activations: Activations,
) -> torch.Tensor:
    """x @ W.T (+ bias) for W stacked from `parts` along its rows, in x's dtype."""
    if len(parts) == 1:
        return quant_linear(x, parts[0], bias, activations)
    outs, row = [], 0
    for part in parts:
        part_bias = None if bias is None else bias[row : row + part.rows]
        outs.append(quant_linear(x, part, part_bias, activations))
        row += part.rows
    return torch.cat(outs, dim=-1)


def dequantized(parts: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([dequantize(p, dtype) for p in parts])


class WeightHolder(nn.Module):
    """A module owning the [rows, cols] matrix `weight`, dense or quantized (`quant`)."""

    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.quant: QuantWeight | None = None
        self.quant_activations: Activations = "int8"

    def hold_quantized(self, parts: list[QuantBlocks], activations: Activations) -> None:
        """Hold `parts` (stacked along the rows) instead of the dense weight, whose storage is
        released."""
        rows, cols = self.weight.shape
        if sum(p.rows for p in parts) != rows or any(p.cols != cols for p in parts):
            shapes = ", ".join(f"[{p.rows}, {p.cols}]" for p in parts)
            raise ValueError(f"quantized parts {shapes} do not make a [{rows}, {cols}] weight")
        self.weight = nn.Parameter(
            torch.empty(rows, cols, dtype=self.weight.dtype, device="meta"),
            requires_grad=False,
        )
        self.quant = merged_parts(parts)
        self.quant_activations = activations

    @property
    def matrix(self) -> LinearWeight:
        """What `linear_any` multiplies: the dense weight or the quantized parts."""
        return self.weight if self.quant is None else self.quant

    def dense_weight(self) -> torch.Tensor:
        """The weight's values as a dense tensor (dequantized: a new tensor each call)."""
        if self.quant is None:
            return self.weight
        return dequantized(self.quant, self.weight.dtype)

    def lookup_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """weight[ids] (an embedding lookup); only these rows are dequantized."""
        if self.quant is None:
            return torch.nn.functional.embedding(ids, self.weight)
        (blocks,) = self.quant  # an embedding is never a fused weight
        dtype = self.weight.dtype
        if (blocks.qtype.name in EXACT_COMPILED_ROWS and dtype in (torch.float32, torch.bfloat16)
                and blocks.data.is_cpu and compiled.available()):
            flat = ids.reshape(-1).to(torch.long).cpu()
            picked = QuantBlocks(blocks.qtype, blocks.data.index_select(0, flat), flat.numel(),
                                 blocks.cols)
            rows = compiled.dequantize(picked, dtype)
            return rows.reshape(*ids.shape, blocks.cols).to(ids.device)
        return dequantize_rows(blocks, ids, dtype).to(ids.device)

    def resident_bytes(self) -> int:
        """Bytes of the matrix as held (blocks when quantized); the bias is not counted."""
        if self.quant is not None:
            return sum(p.nbytes for p in self.quant)
        return self.weight.numel() * self.weight.element_size()


def linear_any(
    dense: Callable[..., torch.Tensor], x: torch.Tensor, weight: LinearWeight,
    bias: torch.Tensor | None, out_dtype: torch.dtype | None, activations: Activations,
) -> torch.Tensor:
    """`dense(x, weight, bias, out_dtype)` for a dense weight; the quantized matmul for
    blocks (in `out_dtype` when given: x widened first, so no precision is lost)."""
    if not isinstance(weight, tuple):
        return dense(x, weight, bias, out_dtype)
    if out_dtype is not None and x.dtype != out_dtype:
        x = x.to(out_dtype)
    return quant_matmul(x, weight, bias, activations)
