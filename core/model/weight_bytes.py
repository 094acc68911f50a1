"""Resident bytes of a model's weights: dense parameters at their size, quantized ones as
their blocks (a parameter shared by two layers, e.g. tied embeddings, counted once)."""

from __future__ import annotations

from torch import nn

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
