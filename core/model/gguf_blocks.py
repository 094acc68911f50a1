"""Reading GGUF tensors as they are stored: a reader that names the tensor a malformed file
breaks on, and each tensor as a dense float tensor or as its raw GGML blocks.

A kept type (`plugserve.quant.types.KEPT_TYPES`) becomes a `QuantBlocks` whose data is a
uint8 view of the reader's memory map ([rows, row_bytes], no copy, nothing dequantized);
F32/F16/BF16 and the other GGML types are dequantized to float32.
"""

from __future__ import annotations

import warnings
from typing import Any

import gguf
import numpy as np
import torch

from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.types import kept_type

UNQUANTIZED = {
    gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F64,
}


class GGUFTensorError(ValueError):
    """A tensor's record or data is malformed: `tensor` names it."""

    def __init__(self, tensor: str, reason: str) -> None:
        super().__init__(f"tensor {tensor!r}: {reason}")
        self.tensor = tensor


class NamingGGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader`, but a tensor whose data cannot be read (the file ends inside it,
    its row is not a whole number of blocks, an unknown type) raises `GGUFTensorError`
    naming it instead of a bare numpy error; and each of the ~100k reads of the metadata (a
    tokenizer's vocabulary and merges) slices a plain ndarray view of the memory map rather
    than the `np.memmap` itself, whose per-slice bookkeeping made opening a file take
    seconds. Tensor data stays a view of the map either way."""

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: Any = None) -> Any:
        plain = self.__dict__.get("_plain")
        if plain is None or plain.base is not self.data:
            plain = self.data.view(np.ndarray)
            self.__dict__["_plain"] = plain
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        tensors: list[Any] = []
        for field in fields:
            name = bytes(field.parts[1]).decode("utf-8", errors="replace")
            if any(t.name == name for t in tensors):
                raise GGUFTensorError(name, "appears twice")
            try:
                super()._build_tensors(start_offs, [field])
            except Exception as exc:
                raise GGUFTensorError(name, _reason(exc)) from exc
            tensors.extend(self.tensors)
        self.tensors = tensors


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "reshape" in text:
        return f"its data is shorter than its shape needs (a truncated file?): {text}"
    return text


def tensor_shape(t: Any) -> tuple[int, ...]:
    """The torch-layout shape ([rows, cols] for a matrix) of a reader tensor."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def dequantized(t: Any) -> torch.Tensor:
    """A reader tensor as float32 in torch layout."""
    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(tensor_shape(t)))
    except Exception as exc:
        raise GGUFTensorError(t.name, f"cannot dequantize its {t.tensor_type.name} data: "
                              f"{_reason(exc)}") from exc


def is_quantized(t: Any) -> bool:
    return t.tensor_type not in UNQUANTIZED


def raw_blocks(t: Any) -> QuantBlocks | None:
    """A 2-D tensor of a kept type as its blocks (a view of the memory map); None for any
    other tensor."""
    qtype = kept_type(t.tensor_type)
    shape = tensor_shape(t)
    if qtype is None or len(shape) != 2:
        return None
    rows, cols = shape
    data = t.data
    want = (rows, qtype.row_bytes(cols))
    if cols % qtype.block_elems or tuple(data.shape) != want or data.dtype != np.uint8:
        raise GGUFTensorError(
            t.name, f"{qtype.name} data of shape {list(data.shape)} does not hold the blocks "
            f"of a [{rows}, {cols}] matrix ({qtype.block_elems} weights per "
            f"{qtype.block_bytes}-byte block: {list(want)} bytes)")
    with warnings.catch_warnings():  # the map is read-only; nothing writes into weights
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(data)
    return QuantBlocks(qtype, tensor, rows, cols)
