"""SpecFootprint: the KV slots a speculative algorithm needs past a request's committed
length. The algorithm states it (`SpecAlgorithm.plan_footprint`); the KV manager sizes the
request rows and each round's reserve from it (DESIGN.md §5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecFootprint:
    """The KV slots a speculative algorithm needs past a request's committed length."""

    alloc_len_per_decode: int  # slots one round may touch, counted from where it starts
    # Slots kept allocated past the committed length before each round. Twice a round: under
    # the overlap loop the round being prepared starts where the round in flight ends.
    reserve_len: int
    extra_row_width: int  # req_to_token row width needed beyond the context length

    @classmethod
    def for_round(cls, alloc_len_per_decode: int, page_size: int) -> SpecFootprint:
        """The usual footprint: a 2-round reserve, and rows widened by it plus a page."""
        reserve = 2 * alloc_len_per_decode
        return cls(alloc_len_per_decode, reserve, reserve + page_size)
