"""KV accounting of speculative decode rounds (DESIGN.md §5), on the KV manager's data.

Before each round a request keeps `reserve_len` slots allocated past its committed length
(the algorithm's footprint: a round touches at most `alloc_len_per_decode` from where it
starts, and under the overlap loop it starts up to one round later than the scheduler knows).
An always-on check refuses a round whose reserve would not fit the request's row.

Committed length: under the normal loop a round adds its accept length when it resolves.
Under the overlap loop the round's first slot (the verified last token's KV, certain to be
written) is pre-claimed when the round is prepared (committed += 1) and resolve adds
`accept_len - 1`. When a request finishes, the round in flight for it still writes its last
token's KV, so that pre-claim is kept (committed = its tokens, as after a plain overlapped
decode); pre-claims of any later rounds are undone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve.fixes import FixToggle
from plugserve.structs.req import Req

if TYPE_CHECKING:
    from plugserve.mem.manager import KVManager

SPEC_V2_BONUS_PRECLAIM = FixToggle(
    "spec_v2_bonus_preclaim",
    "overlap loop: do not pre-claim the bonus slot when a round is prepared; resolve adds "
    "the whole accept length one step late",
)


class SpecAccounting:
    def __init__(
        self, kv: KVManager, reserve_len: int, *, overlap: bool,
        revert_fixes: frozenset[str] = frozenset(),
    ) -> None:
        self.kv = kv
        self.reserve_len = reserve_len  # the algorithm's SpecFootprint.reserve_len
        self.preclaims_bonus = overlap and SPEC_V2_BONUS_PRECLAIM not in revert_fixes

    def target_allocated_len(self, req: Req) -> int:
        """The allocated length a request needs before its next round is launched."""
        committed = req.kv_committed_len + (1 if self.preclaims_bonus else 0)
        return max(req.kv_allocated_len, committed + self.reserve_len)

    def prepare_round(self, req: Req) -> None:
        """Top up the reserve (room was made first) and, under overlap, pre-claim the bonus."""
        needed = self.target_allocated_len(req)
        self.kv.check_row_fits(req, needed, "the next speculative round")
        self.kv.reserve(req, needed)
        if self.preclaims_bonus:
            req.kv_committed_len += 1
            req.spec_preclaims += 1

    def resolve(self, req: Req, accept_len: int) -> None:
        """A round of a live request resolved with `accept_len` emitted tokens."""
        if req.spec_preclaims > 0:
            req.spec_preclaims -= 1
            req.kv_committed_len += accept_len - 1
        else:
            req.kv_committed_len += accept_len

    @staticmethod
    def settle_finished(req: Req) -> None:
        """A request finished with rounds still in flight (overlap loop). The first of them
        starts at the request's last token and writes that token's KV, which its pre-claim
        counted: that claim stays, as the slot a plain decode in flight claimed stays (a
        streaming session then saves the same committed length as without speculation). The
        pre-claims of any later rounds are undone; the KV manager then keeps committed within
        the request's tokens."""
        if req.spec_preclaims > 1:
            req.kv_committed_len -= req.spec_preclaims - 1
        req.spec_preclaims = 0

    @staticmethod
    def forget_round(req: Req) -> None:
        """A round of a finished or retracted request resolved: its pre-claim (if any) is
        gone."""
        if req.spec_preclaims > 0:
            req.spec_preclaims -= 1
