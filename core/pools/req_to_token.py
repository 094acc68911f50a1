"""req_to_token: one row per live request; row[pos] is the KV slot of token `pos`."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, num_rows: int, row_width: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.row_width = row_width
        self.req_to_token = torch.zeros((num_rows, row_width), dtype=torch.int64, device=device)
        # On the CPU, a numpy view of the same memory: a decode's one-slot read and write cost
        # well under a microsecond each instead of a few torch ops.
        self._host = self.req_to_token.numpy() if self.req_to_token.is_cpu else None
        self.free_rows: list[int] = list(range(num_rows - 1, -1, -1))

    def available_rows(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)

    def slot(self, row: int, pos: int) -> int:
        """The KV slot of token `pos` of `row`."""
        if self._host is not None:
            return int(self._host[row, pos])
        return int(self.req_to_token[row, pos])

    def write(self, row: int, start: int, slots: torch.Tensor | list[int]) -> None:
        end = start + (len(slots) if isinstance(slots, list) else int(slots.shape[0]))
        if end > self.row_width:
            raise RuntimeError(
                f"req_to_token row {row} is {self.row_width} slots wide but positions "
                f"[{start}, {end}) were written; the row must be widened (extra row width)"
            )
        if self._host is not None and isinstance(slots, list):
            self._host[row, start:end] = slots
            return
        if isinstance(slots, list):
            slots = torch.tensor(slots, dtype=torch.int64)
        self.req_to_token[row, start:end] = slots.to(self.req_to_token.device)
