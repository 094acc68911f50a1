"""`QuantBlocks`: a [rows, cols] weight matrix held as its GGML blocks, row after row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugserve.quant.types import QuantType


@dataclass(frozen=True)
class QuantBlocks:
    """Raw GGML blocks of a [rows, cols] matrix: `data` is uint8 [rows, qtype.row_bytes(cols)]
    (a view of the file where it is memory-mapped), exactly as llama.cpp stores it."""

    qtype: QuantType
    data: torch.Tensor
    rows: int
    cols: int

    def __post_init__(self) -> None:
        want = (self.rows, self.qtype.row_bytes(self.cols))
        if self.cols % self.qtype.block_elems:
            raise ValueError(
                f"{self.qtype.name}: {self.cols} columns is not a multiple of the block "
                f"size {self.qtype.block_elems}"
            )
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(
                f"{self.qtype.name} blocks of a [{self.rows}, {self.cols}] matrix must be "
                f"uint8 {list(want)}, got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def nbytes(self) -> int:
        """Resident bytes of the blocks."""
        return self.data.numel()

    def row_slice(self, start: int, stop: int) -> QuantBlocks:
        """Rows [start, stop) (a view): rows split at any boundary."""
        return QuantBlocks(self.qtype, self.data[start:stop], stop - start, self.cols)

    def col_slice(self, start: int, stop: int) -> QuantBlocks:
        """Columns [start, stop) (a copy); both ends must be block boundaries."""
        step = self.qtype.block_elems
        if start % step or stop % step:
            raise ValueError(
                f"{self.qtype.name}: columns [{start}, {stop}) do not fall on "
                f"{step}-weight block boundaries"
            )
        per = self.qtype.block_bytes
        data = self.data[:, start // step * per: stop // step * per].contiguous()
        return QuantBlocks(self.qtype, data, self.rows, stop - start)
