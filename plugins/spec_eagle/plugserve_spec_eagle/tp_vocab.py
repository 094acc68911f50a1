"""The draft vocabulary's LM head under tensor parallelism.

The head is replicated on every rank, but it shares the target's LM head, which each rank
holds only its vocabulary rows of (`ModelShard.vocab_range`). So each rank computes the draft
logits of the draft-vocabulary entries whose target ids fall in its rows, and the ranks gather
them. `d2t` is strictly increasing, so those entries are one contiguous run per rank, and the
runs in rank order are the draft vocabulary in order: the gathered logits are exactly the
one-rank head's, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DraftVocabShard:
    shard: Any  # plugserve.model.tp_shard.ModelShard
    local_rows: torch.Tensor  # this rank's LM head rows of its draft entries
    counts: list[int]  # draft entries per rank, in rank order

    @classmethod
    def build(cls, shard: Any, target_ids: torch.Tensor) -> DraftVocabShard:
        """`target_ids[j]`: the target token id of draft entry j (strictly increasing)."""
        ids = target_ids.to("cpu", torch.int64)
        rows, vocab = shard.vocab_rows, shard.arch.vocab_size
        counts = []
        for rank in range(shard.size):
            start = min(rank * rows, vocab)
            stop = min(start + rows, vocab)
            counts.append(int(((ids >= start) & (ids < stop)).sum()))
        start, stop = shard.vocab_range
        local = ids[(ids >= start) & (ids < stop)] - start
        return cls(shard, local, counts)

    def weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the draft LM head, [its draft entries, hidden]."""
        return lm_head_weight.index_select(0, self.local_rows.to(lm_head_weight.device))

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[rows, this rank's entries] -> [rows, draft vocabulary] on every rank."""
        return self.shard.gather_last_dim(local_logits, self.counts)
