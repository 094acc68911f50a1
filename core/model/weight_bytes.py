"""Resident bytes of a model's weights: dense parameters at their size, quantized ones as
their blocks (a parameter shared by two layers, e.g. tied embeddings, counted once), and
apart from them the copies the CPU kernels lay out for themselves (`pack_bytes`)."""

from __future__ import annotations

from torch import nn

from plugserve.kernels.packed_linear import derived_bytes
from plugserve.model.quant_weight import WeightHolder


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight as held: what the model keeps in memory (or maps from a file)."""
    total = 0
    for param in model.parameters():  # each parameter object once
        if param.device.type != "meta":  # a quantized weight's placeholder
            total += param.numel() * param.element_size()
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, WeightHolder) and module.quant is not None:
            for part in module.quant:
                if id(part) not in seen:
                    seen.add(id(part))
                    total += part.nbytes
    return total


def pack_bytes(model: nn.Module) -> int:
    """Bytes the CPU kernels hold now in layouts of their own for `model`'s weights (the GEMM
    library's packs of the many-row linears, the decode batch kernels' packs): made on first
    use, or at a server's start (`plugserve.model.batch_packs`); 0 on a GPU."""
    return sum(derived_bytes(param) for param in model.parameters())
