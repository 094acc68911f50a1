"""Linear layers over block-quantized weights (`plugserve.quant.blocks.QuantBlocks`).

`quant_linear(x, w, bias, activations)` is the one entry the model's layers call for a
quantized weight. `activations="float"` keeps x in its dtype (the result equals x @
dequantize(w).T up to summation order); `"int8"` rounds x through int8 per 32-block first,
as llama.cpp does, so integer dot products can be used.
"""

from __future__ import annotations

import torch

from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations, reference_linear


def quant_linear(
    x: torch.Tensor, w: QuantBlocks, bias: torch.Tensor | None = None,
    activations: Activations = "int8",
) -> torch.Tensor:
    """x [..., w.cols] -> [..., w.rows] in x's dtype."""
    if x.shape[-1] != w.cols:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {w.cols}")
    return reference_linear(x, w, bias, activations)
