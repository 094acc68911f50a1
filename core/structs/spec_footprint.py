"""SpecFootprint: the KV slots a speculative algorithm needs past a request's committed
length. The algorithm states it (`SpecAlgorithm.plan_footprint`); the KV manager sizes the
request rows and each round's reserve from it (DESIGN.md §5, docs/spec_algorithms.md).

Units: row positions of a request's `req_to_token` row, one KV slot each. L is the request's
verified length when a round starts (every token before L has its KV; the last emitted token,
at L, does not yet: the round writes it). The algorithm writes, reads and moves KV only
inside `[L, L + alloc_len_per_decode)` of its requests' rows (plus their committed prefix,
read-only) and never allocates or frees: the core has allocated all of it before the round.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecFootprint:
    """The KV slots a speculative algorithm needs past a request's committed length.

    - `alloc_len_per_decode`: the row positions one round may touch, counted from L: the
      verified tree, the draft tokens' KV, the tail copies of the holey layout (page>1 with
      topk>1: every branch owns whole pages from L's page-aligned base) and the accepted KV's
      move all lie in `[L, L + alloc_len_per_decode)`. It also bounds what a round emits (1 to
      `alloc_len_per_decode` tokens: their KV lies in the footprint).
    - `reserve_len`: before each round the core tops the request's allocation up to its
      committed length (+1 for the pre-claim under the overlap loop) + `reserve_len`. At
      least `alloc_len_per_decode`; with the overlap loop at least twice that, because the
      round being prepared starts up to one round's emitted tokens past the committed length
      the core knows (the round in flight resolves one step late).
    - `extra_row_width`: how much wider than the context the request rows must be, at least
      `reserve_len`, so a request near the end of its context still holds its reserve in its
      row (an always-on check refuses a round whose reserve would not fit; the over-allocated
      tail past a row could never be freed).
    """

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
