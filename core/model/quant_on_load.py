"""`quantization="q8_0"|"q4_0"|"q4_k"` for dense checkpoints: every matrix a layer multiplies
(projections, the embedding, the LM head) is quantized as it streams in; norms and biases
stay dense, and so does a matrix whose column count is not a whole number of blocks (one log
line lists them)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from plugserve.model.errors import ModelLoadError
from plugserve.model.layers import Linear
from plugserve.model.llama import DecoderLayer
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.quantize import ON_LOAD_TYPES, quantizable, quantize
from plugserve.quant.reference import Activations
from plugserve.quant.types import quant_type

log = logging.getLogger(__name__)
_MATRIX_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight", "fc.weight")


def quantizes_on_load(quantization: str | None) -> bool:
    return quantization is not None and quantization != "none"


def check_on_load_type(quantization: str, source: str) -> None:
    if quantization not in ON_LOAD_TYPES:
        raise ModelLoadError(f"{source}: quantization {quantization!r} is not offered; choose "
                             f"one of {', '.join(ON_LOAD_TYPES)} or none")


def is_layer_matrix(name: str, tensor: torch.Tensor) -> bool:
    """A matrix some layer multiplies (or looks rows up in), by its HF name."""
    return tensor.ndim == 2 and name.endswith(_MATRIX_SUFFIXES)


def quantized_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], quantization: str, source: str,
) -> Iterator[tuple[str, torch.Tensor | QuantBlocks]]:
    """`tensors` with each layer matrix replaced by its `quantization` blocks."""
    check_on_load_type(quantization, source)
    qtype = quant_type(quantization)
    dense: list[str] = []
    for name, tensor in tensors:
        if is_layer_matrix(name, tensor):
            if quantizable(tensor.shape[1], qtype):
                yield name, quantize(tensor, quantization)
                continue
            dense.append(f"{name} ({tensor.shape[1]})")
        yield name, tensor
    if dense:
        log.info("%s: kept dense, their column counts not a multiple of the %d-weight %s "
                 "block: %s", source, qtype.block_elems, qtype.name, ", ".join(dense))


def quantize_layers(
    module: nn.Module, quantization: str, activations: Activations, source: str,
) -> None:
    """Quantize the dense matrices of every `Linear` in `module` in place (a model built and
    filled elsewhere, e.g. an EAGLE head); decoder layers holding any then take the per-layer
    torch path."""
    check_on_load_type(quantization, source)
    qtype = quant_type(quantization)
    dense: list[str] = []
    for name, layer in module.named_modules():
        if not isinstance(layer, Linear) or layer.quant is not None:
            continue
        cols = layer.weight.shape[1]
        if quantizable(cols, qtype):
            layer.hold_quantized([quantize(layer.weight, quantization)], activations)
        else:
            dense.append(f"{name} ({cols})")
    for layer in module.modules():
        if isinstance(layer, DecoderLayer) and any(
                isinstance(m, Linear) and m.quant is not None for m in layer.modules()):
            layer.has_llama_form = False
    if dense:
        log.info("%s: kept dense, their column counts not a multiple of the %d-weight %s "
                 "block: %s", source, qtype.block_elems, qtype.name, ", ".join(dense))
