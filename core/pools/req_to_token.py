"""req_to_token: one row per live request; row[pos] is the KV slot of token `pos`."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, num_rows: int, row_width: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.row_width = row_width
        self.req_to_token = torch.zeros((num_rows, row_width), dtype=torch.int64, device=device)
        self.free_rows: list[int] = list(range(num_rows - 1, -1, -1))

    def available_rows(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor | list[int]) -> None:
        if isinstance(slots, list):
            slots = torch.tensor(slots, dtype=torch.int64)
        end = start + int(slots.shape[0])
        if end > self.row_width:
            raise RuntimeError(
                f"req_to_token row {row} is {self.row_width} slots wide but positions "
                f"[{start}, {end}) were written; the row must be widened (extra row width)"
            )
        self.req_to_token[row, start:end] = slots.to(self.req_to_token.device)
