"""The GGML block formats plugserve keeps quantized: elements per block and bytes per block.

A row of `cols` elements is `cols // block_elems` blocks laid out one after another, so a
matrix [rows, cols] is `rows * (cols // block_elems) * block_bytes` bytes. Every other GGML
type is dequantized at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass(frozen=True)
class QuantType:
    name: str  # lower-case GGML name, e.g. "q4_k"
    ggml: GGMLQuantizationType
    block_elems: int  # weights per block
    block_bytes: int  # bytes per block

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights (cols a multiple of block_elems)."""
        return cols // self.block_elems * self.block_bytes

    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_elems


def _entry(ggml: GGMLQuantizationType) -> QuantType:
    elems, nbytes = GGML_QUANT_SIZES[ggml]
    return QuantType(ggml.name.lower(), ggml, elems, nbytes)


KEPT_TYPES: dict[str, QuantType] = {
    entry.name: entry
    for entry in (
        _entry(t)
        for t in (
            GGMLQuantizationType.Q8_0,
            GGMLQuantizationType.Q4_0,
            GGMLQuantizationType.Q4_1,
            GGMLQuantizationType.Q5_0,
            GGMLQuantizationType.Q5_1,
            GGMLQuantizationType.Q4_K,
            GGMLQuantizationType.Q5_K,
            GGMLQuantizationType.Q6_K,
        )
    )
}


def kept_type(ggml: GGMLQuantizationType) -> QuantType | None:
    """The kept format for a GGML tensor type, or None when it is dequantized on load."""
    return KEPT_TYPES.get(ggml.name.lower())


def quant_type(name: str) -> QuantType:
    """A kept format by its lower-case name; a ValueError naming the allowed ones otherwise."""
    try:
        return KEPT_TYPES[name.lower()]
    except KeyError:
        allowed = ", ".join(KEPT_TYPES)
        raise ValueError(f"unknown quantized type {name!r}; allowed: {allowed}") from None
