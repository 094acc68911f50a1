"""One request's grammar as a speculative round walks its verified tree: mask a node's logits
for the tokens accepted so far, then accept the token chosen there.

A speculative algorithm gets one per constrained request (`token_constraint`) and walks the
accepted path node by node: at each node it masks the target's logits (`mask`), picks the
token exactly as plain decoding would from the masked logits, and `accept`s it; it stops at
the first node whose chosen token is not the next draft token (the bonus), or when the grammar
is complete. The tokens the matcher sees are the emitted ones only, so a rejected draft never
reaches it (nothing to roll back), and the emitted tokens are those plain decoding under the
same grammar gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from plugserve.grammar.service import GrammarService
from plugserve.grammar.state import GrammarState


class TokenConstraint:
    def __init__(self, service: GrammarService, state: GrammarState) -> None:
        self.service = service
        self.state = state

    @property
    def terminated(self) -> bool:
        matcher = self.state.matcher
        return matcher is not None and matcher.is_terminated()

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """A masked copy of one node's logits `[vocab]` (as they are when complete)."""
        out = row.clone()
        if not self.terminated:
            assert self.state.matcher is not None
            self.service.backend.apply_masks(out[None], [0], [self.state.matcher])
        return out

    def accept(self, token: int) -> None:
        self.state.accept(token)


def token_constraint(service: GrammarService | None, req: Any, output_ids: Sequence[int],
                     ) -> TokenConstraint | None:
    """The constraint of `req` positioned after `output_ids` (the tokens the forward thread
    knows it emitted), or None for a free request."""
    state = req.grammar
    if service is None or not isinstance(state, GrammarState):
        return None
    state.sync(service.backend, output_ids, len(output_ids), service.capabilities.rollback)
    return TokenConstraint(service, state)
