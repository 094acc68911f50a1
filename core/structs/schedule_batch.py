"""ScheduleBatch: the requests of one step and the token layout the runner turns into a
ForwardBatch.

Batches are compared by identity only (`eq=False`): the checker counts the running batch next
to the last batch only when it is a different object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.req import Req


@dataclass(eq=False)
class ScheduleBatch:
    # Rows of the requests at the time the batch was prepared.
    req_pool_indices: torch.Tensor
    reqs: list[Req]
    mode: ForwardMode
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    out_cache_loc: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    # Requests whose next token is sampled from this forward (False: a non-final prefill chunk).
    sample_mask: list[bool] = field(default_factory=list)
    num_decode_reqs: int = 0  # mixed batches: the trailing requests that decode

    @classmethod
    def empty(cls) -> ScheduleBatch:
        return cls(torch.empty(0, dtype=torch.int64), [], ForwardMode.DECODE)

    def is_empty(self) -> bool:
        return not self.reqs

    def filter_finished(self) -> None:
        self.reqs = [r for r in self.reqs if not r.finished() and not r.is_retracted]

    def refresh_rows(self) -> None:
        self.req_pool_indices = torch.tensor(
            [r.req_pool_idx if r.req_pool_idx is not None else 0 for r in self.reqs],
            dtype=torch.int64,
        )

    def __len__(self) -> int:
        return len(self.reqs)
