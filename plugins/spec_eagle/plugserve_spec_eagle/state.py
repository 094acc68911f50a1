"""Per-request EAGLE progress, kept on `req.spec_state` and touched only by the forward
thread (under the overlap loop the scheduler learns a round's result one step late)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class EagleReqState:
    verified_len: int  # positions whose target KV is written and accepted
    last_token: int  # the verified token at position verified_len (its KV comes next round)
    token_ids: list[int] = field(default_factory=list)  # every token through last_token
    # The draft's first step, drafted when the draft caught up: its top-k (target ids), their
    # log-probabilities, and the draft hidden state they came from.
    seed_ids: torch.Tensor | None = None
    seed_logprobs: torch.Tensor | None = None
    seed_hidden: torch.Tensor | None = None
