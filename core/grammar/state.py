"""One request's grammar progress: its compiled grammar, its matcher and how many of its
output tokens the matcher has accepted.

Only the forward thread touches the matcher (the sampler's grammar step builds it, masks with
it, and advances it over each token it samples). The scheduler reads `terminated_at` only.

Which tokens the matcher has seen: it is advanced right after the token is sampled, on the
forward thread, so when the next forward masks the request the matcher already holds every
earlier token, even in the overlap loop where the scheduler prepared that forward before it
learnt the token. `sync` still compares the count with the output tokens the forward says came
before (a retracted request recomputed, a forward prepared for a request that finished in the
one before) and catches up or rolls back, so the mask is always for the right prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plugserve.grammar.base import GrammarBackend, GrammarMatcher


class GrammarState:
    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.matcher: GrammarMatcher | None = None
        self.accepted = 0  # output tokens the matcher has accepted
        # Output tokens after which the grammar was complete (its EOS accepted): the request
        # finishes there with reason "stop".
        self.terminated_at: int | None = None
        self.rejected: str | None = None  # a sampled token the grammar refused

    def sync(self, backend: GrammarBackend, output_ids: Sequence[int], done: int,
             can_rollback: bool) -> GrammarMatcher:
        """The matcher, positioned after the first `done` output tokens."""
        if self.matcher is None or (self.accepted > done and not can_rollback):
            self.matcher, self.accepted, self.terminated_at = (
                backend.new_matcher(self.compiled), 0, None)
        if self.accepted > done:
            self.matcher.rollback(self.accepted - done)
            self.accepted = done
            if self.terminated_at is not None and self.terminated_at > done:
                self.terminated_at = None
        for token in output_ids[self.accepted:done]:
            self.accept(token)
        return self.matcher

    def accept(self, token: int) -> None:
        assert self.matcher is not None
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(int(token)):
            self.rejected = f"the grammar refused token {int(token)} after {self.accepted} tokens"
            return
        self.accepted += 1
        if self.matcher.is_terminated():
            self.terminated_at = self.accepted
