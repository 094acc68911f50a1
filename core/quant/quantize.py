"""Weight-only quantization on load (`--quantization q8_0|q4_0|q4_k`): a dense [rows, cols]
matrix into the GGML blocks llama.cpp would write. Q8_0 and Q4_0 come from
`gguf.quants.quantize`; Q4_K from `plugserve.quant.q4_k` (gguf does not quantize it)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.q4_k import quantize_q4_k
from plugserve.quant.types import QuantType, quant_type

# What --quantization offers (the names of the kept types it writes).
ON_LOAD_TYPES = ("q8_0", "q4_0", "q4_k")


def quantizable(cols: int, qtype: QuantType) -> bool:
    """Whether a matrix of `cols` columns splits into whole blocks of `qtype`."""
    return cols % qtype.block_elems == 0


def quantize(weight: torch.Tensor, name: str) -> QuantBlocks:
    """`weight` [rows, cols] (any float dtype, cols a multiple of the block) as `name`
    blocks."""
    qtype = quant_type(name)
    if qtype.name not in ON_LOAD_TYPES:
        raise ValueError(f"quantizing to {qtype.name} is not offered; choose one of "
                         f"{', '.join(ON_LOAD_TYPES)}")
    rows, cols = weight.shape
    if not quantizable(cols, qtype):
        raise ValueError(f"{qtype.name}: {cols} columns is not a multiple of the block size "
                         f"{qtype.block_elems}")
    values = weight.detach().to(torch.float32).cpu().numpy()
    if qtype.name == "q4_k":
        raw = quantize_q4_k(values)
    else:
        raw = gguf.quants.quantize(values, qtype.ggml)
    data = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))
    return QuantBlocks(qtype, data.reshape(rows, qtype.row_bytes(cols)), rows, cols)
