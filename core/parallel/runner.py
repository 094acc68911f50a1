"""The model runner of a tensor-parallel rank: rank 0 samples, the others take its tokens.

Every rank holds the same gathered logits (the vocabulary-parallel LM head gathers them, the
same bits everywhere), so every rank *would* sample the same tokens on one machine. Across
machines, or with kernels that round differently, that is a hope, not a guarantee, and one
different token would make the ranks' schedules, KV and accounting drift apart. So rank 0
samples and broadcasts its token ids (and which rows failed) on the model group: one small
int64 tensor per forward, cheap next to the all-reduces, and the followers skip the sampler.
"""

from __future__ import annotations

from typing import Any

import torch

from plugserve.kernels import row_argmax
from plugserve.model.tp_shard import ModelShard
from plugserve.runner.model_runner import ModelRunner
from plugserve.runner.sampler import Sampled
from plugserve.structs.step import PreparedStep

FOLLOWER_SAMPLE_ERROR = "rank 0 could not sample a token for this request"


class TPModelRunner(ModelRunner):
    def __init__(self, *args: Any, shard: ModelShard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard = shard
        # Only rank 0 samples: load the sampler's kernel now, on every rank, so that its
        # first-use compile never keeps the others waiting in a collective.
        if self.device.type == "cpu":
            row_argmax.available()

    def _sample(self, step: PreparedStep, logits: torch.Tensor) -> Sampled:
        rows = len(step.sample_rows)
        message = torch.empty(2, rows, dtype=torch.int64)
        sampled: Sampled | None = None
        if self.shard.rank == 0:
            sampled = super()._sample(step, logits)
            message[0] = torch.tensor(sampled.ids, dtype=torch.int64)
            message[1] = torch.tensor([e is not None for e in sampled.errors], dtype=torch.int64)
        self.shard.broadcast_(message)
        if sampled is not None:
            return sampled
        ids, failed = message.tolist()
        return Sampled(ids, None, [FOLLOWER_SAMPLE_ERROR if f else None for f in failed])
