"""The KV rules of streaming sessions (DESIGN.md §6), on the KV manager's data.

    begin_turn   a turn is queued: rewind the slot to the turn's offset (truncated pages freed)
    lend         admission of a later turn: the request borrows the slot's row and KV
    save         the turn finished: its committed KV moves into the slot; the overshoot past
                 it (speculative reserve, over-allocation) is freed from a page boundary
    give_back    the turn was aborted / failed / retracted: the turn's own pages are freed and
                 the slot is as it was after the previous turn (a retried turn lends again)
    close        close_session / timeout: everything the slot owns is freed, its lock and row
                 given back

Hybrid sliding-window models: the slot keeps `swa_evicted_seqlen`; a slot left without its
last window of SWA KV (rewound before it, or a turn gave back what it had freed) gives its
KV back, and the next turn recomputes (`_keep_window`).

A first turn (the slot has no row yet) is admitted like any request and may share a prefix
through the prefix cache; later turns bypass tree matching. Session turns never insert into
the prefix cache: the slot owns their KV.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from plugserve.fixes import FixToggle
from plugserve.mem.sessions import SessionError, SessionSlot, SessionStore
from plugserve.pools.allocator import ceil_align
from plugserve.structs.req import Req

if TYPE_CHECKING:
    from plugserve.mem.manager import KVManager

SESSION_DOUBLE_COUNT = FixToggle(
    "session_double_count",
    "count a session slot lent to a running request in session_held too (the checker then "
    "reports a false leak)",
)
SESSION_RETRACT_TAIL_LEAK = FixToggle(
    "session_retract_tail_leak",
    "retracting a session turn does not free the turn's own pages past the slot's KV",
)


class SessionKV:
    def __init__(self, kv: KVManager, store: SessionStore, revert_fixes: frozenset[str]) -> None:
        self.kv = kv
        self.store = store
        store.count_lent_too = SESSION_DOUBLE_COUNT in revert_fixes
        self._retract_keeps_tail = SESSION_RETRACT_TAIL_LEAK in revert_fixes

    # --- a turn is queued -----------------------------------------------------------------
    def turn_ids(self, session_id: object, new_ids: list[int], offset: object) -> list[int]:
        """The turn's whole prompt (the conversation up to `offset`, then `new_ids`); raises
        SessionError if the session cannot take a turn now."""
        slot = self.store.get(session_id)
        if slot.turn_rid is not None:
            raise SessionError(
                f"session {slot.session_id} already has a turn in progress (request "
                f"{slot.turn_rid}); wait for it to finish or abort it"
            )
        length = len(slot.token_ids)
        if offset is None:
            return slot.token_ids + new_ids
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= length:
            raise SessionError(
                f"session_offset must be an integer in [0, {length}] (the session's length in "
                f"tokens), got {offset!r}"
            )
        return slot.token_ids[:offset] + new_ids

    def begin_turn(self, req: Req, offset: int | None) -> None:
        """The turn's request is queued: the slot is busy with it, rewound to `offset`."""
        slot = self.store.get(req.session_id)
        if offset is not None and offset < len(slot.token_ids):
            self._rewind(slot, offset)
        slot.turn_rid = req.rid
        slot.last_used_s = time.monotonic()

    def _rewind(self, slot: SessionSlot, offset: int) -> None:
        """Keep the first `offset` tokens: pages wholly past them are freed. Below the cache's
        locked prefix, lock the (shorter) cached prefix of what is kept instead."""
        kv, page = self.kv, self.kv.page_size
        slot.token_ids = slot.token_ids[:offset]
        if slot.row is None:
            return
        row = kv.rows.req_to_token[slot.row]
        # Row entries past the committed length are stale: free pages through what it holds.
        held = slot.kv_committed_len
        if offset < slot.cache_protected_len:
            kv.allocator.free_slots(row[slot.cache_protected_len : held].clone())
            match = kv.cache.match_prefix(slot.token_ids)
            kv.cache.inc_lock_ref(match.node)
            kv.cache.dec_lock_ref(slot.last_node)
            slot.last_node = match.node
            slot.cache_protected_len = slot.kv_committed_len = match.length
            # Its own pages are gone: nothing of its own fell out of the window either.
            slot.swa_evicted_seqlen = min(slot.swa_evicted_seqlen, match.length)
            self._keep_window(slot)
            return
        slot.kv_committed_len = min(slot.kv_committed_len, offset)
        kv.allocator.free_slots(row[ceil_align(slot.kv_committed_len, page) : held].clone())
        self._keep_window(slot)

    def _keep_window(self, slot: SessionSlot) -> None:
        """Hybrid sliding-window model: a slot whose last window of SWA KV is gone (rewound
        before it, or a turn that gave back what it had freed) cannot be continued; its KV,
        lock and row are given back and the next turn is admitted afresh (it may match the
        prefix cache), recomputing the conversation."""
        window = self.kv.swa_window
        if window is None or slot.row is None or window.window_intact(slot.row,
                                                                       slot.kv_committed_len):
            return
        self._drop_kv(slot)
        slot.kv_committed_len = slot.cache_protected_len = slot.swa_evicted_seqlen = 0

    # --- admission and the turn's end -----------------------------------------------------
    def lend(self, req: Req) -> bool:
        """Admit a later turn on the slot's row and KV; False for a first turn (no row yet:
        it is admitted like any request)."""
        slot = self.store.get(req.session_id)
        if slot.row is None:
            return False
        req.req_pool_idx = slot.row
        req.is_retracted = False
        req.last_node = slot.last_node
        req.cache_protected_len = slot.cache_protected_len
        req.kv_committed_len = req.kv_allocated_len = slot.kv_committed_len
        req.swa_evicted_seqlen = slot.swa_evicted_seqlen
        if req.retract_count == 0:
            req.cached_tokens = slot.kv_committed_len
        slot.lent = True
        return True

    def save(self, req: Req) -> None:
        """A turn finished: its committed KV (and row, and lock) move into the slot."""
        slot = self.store.get(req.session_id)
        row = req.req_pool_idx
        assert row is not None
        slots = self.kv.rows.req_to_token[row, : req.kv_allocated_len].clone()
        self.kv.free_overallocated(req, slots)
        req.kv_committed_freed = True  # handed over, not freed: the slot owns it now
        slot.row = row
        slot.kv_committed_len = req.kv_committed_len
        slot.cache_protected_len = req.cache_protected_len
        slot.swa_evicted_seqlen = req.swa_evicted_seqlen
        slot.last_node = req.last_node
        slot.token_ids = list(req.all_ids)
        self._end_turn(slot, req)
        req.finish_released = True

    def give_back(self, req: Req, *, retract: bool) -> None:
        """Free what the turn added past the slot's KV; the slot keeps what it had."""
        slot = self.store.get(req.session_id)
        assert req.req_pool_idx is not None and slot.row == req.req_pool_idx
        if not (retract and self._retract_keeps_tail):
            start = ceil_align(slot.kv_committed_len, self.kv.page_size)
            tail = self.kv.rows.req_to_token[slot.row, start : req.kv_allocated_len].clone()
            self.kv.allocator.free_slots(tail)
        # The turn may have freed SWA pages of the slot's own KV out of its window.
        slot.swa_evicted_seqlen = max(slot.swa_evicted_seqlen, min(
            req.swa_evicted_seqlen, ceil_align(slot.kv_committed_len, self.kv.page_size)))
        slot.lent = False
        req.req_pool_idx = None
        req.last_node = None
        self._keep_window(slot)
        if retract:
            return
        req.kv_committed_freed = req.kv_overallocated_freed = True
        self._end_turn(slot, req)
        req.finish_released = True

    def forget_turn(self, req: Req) -> None:
        """A queued turn ended before it was admitted (aborted while waiting)."""
        slot = self.store.slots.get(req.session_id or "")
        if slot is not None and slot.turn_rid == req.rid:
            slot.turn_rid = None

    def _end_turn(self, slot: SessionSlot, req: Req) -> None:
        slot.lent = False
        if slot.turn_rid == req.rid:
            slot.turn_rid = None
        slot.last_used_s = time.monotonic()
        req.req_pool_idx = None
        req.last_node = None

    def owns_row(self, req: Req) -> bool:
        """The request runs on its session's row (a later turn, lent)."""
        slot = self.store.slots.get(req.session_id or "")
        return slot is not None and slot.row is not None and slot.row == req.req_pool_idx

    def locked_prefix_slots(self, pool: str = "full") -> int:
        """Cached slots of `pool` ("full" or "swa") the open slots keep locked between turns
        (their first turn's matched prefix): at idle, the only slots the cache may still
        protect in that pool."""
        nodes = [s.last_node for s in self.store.slots.values() if s.row is not None]
        if pool == "swa":
            return self.kv.cache.swa_path_size(nodes)
        return self.kv.cache.path_size(nodes)

    # --- closing --------------------------------------------------------------------------
    def close(self, session_id: object) -> None:
        slot = self.store.get(session_id)
        if slot.turn_rid is not None:
            raise SessionError(
                f"session {slot.session_id} has a turn in progress (request {slot.turn_rid}); "
                "abort it or wait for it before closing the session"
            )
        self._drop_kv(slot)
        del self.store.slots[slot.session_id]

    def _drop_kv(self, slot: SessionSlot) -> None:
        """Give back everything the slot owns: its pages, its cache lock, its row."""
        if slot.row is not None:
            kv = self.kv
            kv.allocator.free_slots(  # whole pages through the committed length
                kv.rows.req_to_token[slot.row, slot.cache_protected_len : slot.kv_committed_len]
                .clone()
            )
            kv.cache.dec_lock_ref(slot.last_node)
            kv.rows.free(slot.row)
            slot.row = None
            slot.last_node = None

    def reap(self, now: float | None = None) -> list[str]:
        """Close every idle session past its timeout; returns their ids."""
        expired = self.store.expired(time.monotonic() if now is None else now)
        for slot in expired:
            self.close(slot.session_id)
        return [slot.session_id for slot in expired]
