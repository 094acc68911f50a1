"""KVManager: the one owner of KV memory (DESIGN.md §3-§5).

It holds the request-row table (`req_to_token`), the accounted pools with their page
allocators, and the prefix cache. The scheduler decides *who* runs; the manager decides *what
memory* that takes. Each operation below is one step of a request's life and changes the
lengths it documents. Nothing outside `plugserve.mem` writes `kv_committed_len`,
`kv_allocated_len`, `cache_protected_len`, a row or an allocator; inside it, only this class
and the two next door (below) do:

    admit            row + locked cached prefix          committed = allocated = protected = match
    fork             a sample of n > 1: row + the lock   committed = allocated = protected =
                     on its parent's cached prompt       floor_align(prompt - 1)
    extend           a prefill chunk's slots             committed = allocated += chunk
    cache_unfinished a chunk's aligned prefix -> cache   protected = floor_align(committed)
    claim_decode     the slot the next forward writes    committed += 1, allocated += 1
    reserve          a speculative round's slots         allocated = target
    finish           the request ended                   committed <= tokens; released once no
                                                         forward in flight writes its KV
    release          (from finish)                       cache committed prefix, free the rest
    retract          out of memory                       free without caching, lengths reset

The scheduler asks before it acts, in pairs: `can_extend` / `extend`, `can_decode` /
`claim_decode` (or `spec.prepare_round`). A `can_*` answer makes the room it promises (it
evicts from the prefix cache), so the act that follows cannot fail; the scheduler does no KV
arithmetic of its own.

Next door, on the same data: speculative committed-length bookkeeping (pre-claims under the
overlap loop) in `plugserve.mem.spec_accounting` (owned here, `self.spec`), the KV of
streaming sessions (a turn borrows its session's row and KV and hands them back) in
`plugserve.mem.session_kv`, and the samples of an n > 1 request forking their parent's
cached prompt in `plugserve.mem.sample_fork` (`self.forks`).
"""

from __future__ import annotations

import torch

from plugserve.cache.base import PrefixCache
from plugserve.fixes import FixToggle
from plugserve.mem.accounting import AccountedPool, PoolTerms, no_slots
from plugserve.mem.sample_fork import FORK_WITHOUT_LOCK, SampleFork
from plugserve.mem.session_kv import SessionKV
from plugserve.mem.sessions import SessionStore
from plugserve.mem.spec_accounting import SpecAccounting
from plugserve.mem.swa_window import SWAWindow
from plugserve.pools.allocator import PagedAllocator, ceil_align, floor_align
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.pools.swa_pool import HybridAllocator
from plugserve.structs.req import Req

FINISH_OVERALLOC_UNALIGNED = FixToggle(
    "finish_overalloc_unaligned",
    "free over-allocation from the committed length, not from its page boundary",
)
RETRACT_NO_RESET = FixToggle(
    "retract_no_reset", "retract a request without resetting its KV lengths"
)


class KVManager:
    def __init__(
        self,
        *,
        rows: ReqToTokenPool,
        allocator: PagedAllocator,
        cache: PrefixCache,
        prefix_sharing: bool,
        sessions: bool = False,
        revert_fixes: frozenset[str] = frozenset(),
        sliding_window: int | None = None,
        spec_reserve_len: int | None = None,
        overlap: bool = False,
    ) -> None:
        self.rows = rows
        self.cache = cache
        self.page_size = allocator.page_size
        self.prefix_sharing = prefix_sharing
        # Streaming sessions, when the cache policy supports them; at most one per row.
        self.sessions = (
            SessionKV(self, SessionStore(rows.num_rows), revert_fixes) if sessions else None
        )
        store = self.sessions.store if self.sessions is not None else None
        self.full = AccountedPool(
            "full", allocator, cache.evictable_size, cache.protected_size,
            session_held=(lambda: store.held_slots(self.page_size)) if store else no_slots,
            evict=cache.evict,
        )
        self.pools: list[AccountedPool] = [self.full]
        # A hybrid sliding-window model: its windowed layers' KV lives in a second, accounted
        # pool whose pages map 1:1 onto full pages (plugserve.pools.swa_pool).
        self.swa_window: SWAWindow | None = None
        if isinstance(allocator, HybridAllocator):
            assert sliding_window is not None, "a SWA pool needs the model's window"
            self.swa_window = SWAWindow(allocator, rows, sliding_window, revert_fixes)
            self.pools.append(AccountedPool(
                "swa", allocator.swa,
                cache.swa_evictable_size,
                cache.swa_protected_size,
                req_not_owned_prefix=self.swa_window.not_owned_prefix,
                session_held=(lambda: store.held_swa_slots(self.page_size)) if store
                else no_slots,
                evict=cache.evict_swa,
            ))
        # Speculative decoding: each round keeps `spec_reserve_len` slots allocated past the
        # committed length (the algorithm's footprint); None = no speculation.
        self.spec = (
            SpecAccounting(self, spec_reserve_len, overlap=overlap, revert_fixes=revert_fixes)
            if spec_reserve_len is not None else None
        )
        self._overalloc_from_committed = FINISH_OVERALLOC_UNALIGNED in revert_fixes
        self._retract_keeps_lengths = RETRACT_NO_RESET in revert_fixes
        self.forks = SampleFork(self, without_lock=FORK_WITHOUT_LOCK in revert_fixes)

    @property
    def allocator(self) -> PagedAllocator:
        """The full-attention pool's allocator (the one every request position maps into)."""
        return self.full.allocator

    # --- accounting -----------------------------------------------------------------------
    def terms(self, reqs: list[Req]) -> tuple[PoolTerms, ...]:
        """Each pool's conservation terms with `reqs` owning KV (the busy check), or none
        (the idle check)."""
        return tuple(pool.terms(reqs) for pool in self.pools)

    def session_held_rows(self) -> int:
        """Rows owned by streaming-session slots."""
        return self.sessions.store.held_rows() if self.sessions is not None else 0

    def session_locked_slots(self, pool: str) -> int:
        """Slots of `pool` the cache protects for open streaming sessions (their first turn's
        matched prefix stays locked between turns): at idle, all it may protect."""
        return self.sessions.locked_prefix_slots(pool) if self.sessions is not None else 0

    def forget_waiting(self, req: Req) -> None:
        """A request ended before it was admitted (aborted while waiting)."""
        if req.session_id is not None and self.sessions is not None:
            self.sessions.forget_turn(req)

    def _lent_session_row(self, req: Req) -> bool:
        return (req.session_id is not None and self.sessions is not None
                and self.sessions.owns_row(req))

    def rows_problem(self) -> str | None:
        """At idle every row is free or held by a session; otherwise say what is off."""
        free, held, total = self.rows.available_rows(), self.session_held_rows(), self.rows.num_rows
        if free + held == total:
            return None
        return f"request rows not whole: free {free} + session-held {held} != rows {total}"

    # --- admission ------------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Give a waiting request a row and lock its cached prefix. False if no row is free."""
        if req.kv_allocated_len or req.req_pool_idx is not None:
            raise RuntimeError(
                f"request {req.rid} enters prefill still holding KV state (row "
                f"{req.req_pool_idx}, committed {req.kv_committed_len}, allocated "
                f"{req.kv_allocated_len}); a retract must reset its lengths"
            )
        if req.session_id is not None and self.sessions is not None and self.sessions.lend(req):
            return True
        row = self.rows.alloc()
        if row is None:
            return False
        # Prompt logprobs need every prompt position computed: such a request reads no
        # cached prefix (what it computes is inserted at its end like any other).
        reads_cache = req.sampling.prompt_logprobs is None
        match = self.cache.match_prefix(req.all_ids[:-1] if reads_cache else [])
        req.req_pool_idx = row
        req.is_retracted = False
        req.last_node = match.node
        self.cache.inc_lock_ref(match.node)
        if match.length:
            self.rows.write(row, 0, match.slots)
        req.cache_protected_len = match.length
        req.kv_committed_len = req.kv_allocated_len = match.length
        if req.retract_count == 0:
            req.cached_tokens = match.length
        return True

    # --- n > 1: a sample forks its parent's cached prompt (plugserve.mem.sample_fork) -------
    def can_fork(self, req: Req) -> bool:
        """Whether `fork` can run now: a free row, and the parent still locks its prompt."""
        return self.forks.can_fork(req)

    def fork(self, req: Req) -> None:
        """Admit a sample with its parent's cached prompt pages, locked for the sample too."""
        self.forks.fork(req)

    def unadmit(self, req: Req) -> None:
        """Undo `admit` for a request that got no memory this step (nothing else was taken)."""
        assert req.req_pool_idx is not None
        if self._lent_session_row(req):
            assert self.sessions is not None
            self.sessions.give_back(req, retract=True)
        else:
            self.cache.dec_lock_ref(req.last_node)
            self.rows.free(req.req_pool_idx)
        req.reset_for_retract()

    # --- asking before acting --------------------------------------------------------------
    def decode_pages_per_req(self) -> int:
        """Pages one running request may take in its next decode step: one page, or a
        speculative round's whole reserve."""
        if self.spec is None:
            return 1
        return -(-self.spec.reserve_len // self.page_size) + 1

    def can_extend(self, req: Req, extend_len: int, running_decodes: int) -> bool:
        """Whether a prefill chunk of `extend_len` tokens fits while `running_decodes` running
        requests keep room for their next decode (a long prompt must not push them into
        retract). True = that room is made (the cache evicted as needed): `extend` follows."""
        need = self._pages_to_grow(req, req.kv_allocated_len + extend_len)
        return self._ensure_free_pages(need + running_decodes * self.decode_pages_per_req())

    def can_decode(self, reqs: list[Req]) -> bool:
        """Whether every request of `reqs` gets the slots of its next decode (one slot, or a
        speculative round's reserve). True = that room is made: `claim_decode` or
        `spec.prepare_round` follows for each."""
        return self._ensure_free_pages(self.decode_pages_needed(reqs))

    def decode_pages_needed(self, reqs: list[Req]) -> int:
        """New pages the next decode of every request of `reqs` takes."""
        return sum(self._pages_to_grow(r, self._decode_target_len(r)) for r in reqs)

    def _decode_target_len(self, req: Req) -> int:
        if self.spec is not None:
            return self.spec.target_allocated_len(req)
        return req.kv_allocated_len + 1

    def idle_sessions_in_the_way(self) -> str | None:
        """When idle streaming sessions hold KV (they keep it between turns), why a request
        that finds no room cannot run until some close; None when they hold none."""
        held = sum(pool.session_held() for pool in self.pools)
        if not held:
            return None
        alloc = self.allocator
        return (f"request needs KV slots that idle streaming sessions hold ({held} slots in "
                f"session slots, {alloc.available_size()} of {alloc.total_slots} free): close "
                "sessions or raise kv_pool_tokens")

    def capacity(self) -> str:
        """What the full pool holds now, for error messages."""
        alloc = self.allocator
        return (f"{alloc.available_size()} of {alloc.total_slots} KV slots free, "
                f"{self.cache.evictable_size()} evictable, {self.cache.protected_size()} "
                f"locked by the cache, {self.rows.available_rows()} of {self.rows.num_rows} "
                "rows free")

    # --- allocation -----------------------------------------------------------------------
    def _ensure_free_pages(self, num_pages: int) -> bool:
        """Make `num_pages` free pages in every pool (a full page takes a SWA page too),
        evicting unlocked cache entries if needed."""
        need = num_pages * self.page_size
        for pool in self.pools:
            short = need - pool.allocator.available_size()
            if short > 0:
                pool.evict(short)
        return all(pool.allocator.available_size() >= need for pool in self.pools)

    def evict_out_of_window(self, reqs: list[Req]) -> None:
        """Free the SWA KV that fell out of live requests' windows (no-op without a SWA
        pool). The scheduler calls it before it builds each batch."""
        if self.swa_window is not None:
            self.swa_window.evict(reqs)

    def _pages_to_grow(self, req: Req, new_allocated_len: int) -> int:
        """New pages the request needs to reach `new_allocated_len` allocated slots."""
        return self.allocator.pages_needed(req.kv_allocated_len,
                                           max(req.kv_allocated_len, new_allocated_len))

    def _last_slot(self, req: Req) -> int:
        if req.kv_allocated_len == 0:
            return -1
        assert req.req_pool_idx is not None
        return self.rows.slot(req.req_pool_idx, req.kv_allocated_len - 1)

    def _grow(self, req: Req, new_allocated_len: int, why: str) -> list[int]:
        """Allocate row positions [allocated, new_allocated_len). The scheduler asked first
        (`can_extend` / `can_decode`), so a pool still short is a broken promise."""
        old = req.kv_allocated_len
        if not self._ensure_free_pages(self._pages_to_grow(req, new_allocated_len)):
            raise RuntimeError(f"no room for {why} of {req} ({self.capacity()}); the scheduler "
                               "must ask can_extend / can_decode first")
        slots = self.allocator.extend_slots(self._last_slot(req), old, new_allocated_len)
        assert slots is not None and req.req_pool_idx is not None
        self.rows.write(req.req_pool_idx, old, slots)
        req.kv_allocated_len = new_allocated_len
        return slots

    def extend(self, req: Req, extend_len: int) -> list[int]:
        """Slots for a prefill chunk of `extend_len` tokens after the committed KV."""
        prefix = req.kv_allocated_len
        slots = self._grow(req, req.kv_allocated_len + extend_len, "a prefill chunk")
        req.kv_committed_len = req.kv_allocated_len
        req.swa_read_from = prefix  # the chunk's first query
        return slots

    def claim_decode(self, req: Req) -> int:
        """Claim the slot the next decode forward writes (committed += 1, allocated += 1)."""
        req.swa_read_from = req.kv_allocated_len  # the decode's one query
        slots = self._grow(req, req.kv_allocated_len + 1, "the decode")
        req.kv_committed_len += 1
        return slots[0]

    def check_row_fits(self, req: Req, allocated_len: int, why: str) -> None:
        """Always on: an allocation past the row would never be freed (it would leak)."""
        width = self.rows.row_width
        if allocated_len > width:
            raise RuntimeError(
                f"request {req.rid}: {why} needs allocated length {allocated_len} but its "
                f"req_to_token row is only {width} slots wide (committed "
                f"{req.kv_committed_len}); the rows must be widened for it"
            )

    def reserve(self, req: Req, allocated_len: int) -> None:
        """Keep at least `allocated_len` slots allocated (a speculative round's reserve)."""
        # The round verifies from the committed length (under overlap it starts no earlier
        # than this, resolved one round late); one position earlier to be safe.
        req.swa_read_from = max(req.kv_committed_len - 1, 0)
        if allocated_len > req.kv_allocated_len:
            self._grow(req, allocated_len, "the speculative reserve")

    # --- the end of a request ---------------------------------------------------------------
    def finish(self, req: Req) -> None:
        """The request ended (finished, aborted or failed; its reason is set). Its committed
        length is settled, then its KV is released once no forward writes it."""
        if self.spec is not None:
            self.spec.settle_finished(req)
        # A forward in flight may have claimed the slot of a token that never came (an
        # error, an abort): only KV of real tokens is committed, the rest is over-allocation.
        req.kv_committed_len = min(req.kv_committed_len, req.seq_len)
        self.release_if_done(req)

    def release_if_done(self, req: Req) -> None:
        """Release a finished request's KV once no forward that writes it is in flight (the
        overlap loop may still be running one)."""
        if req.finish_released or req.pending_forwards > 0:
            return
        if req.req_pool_idx is None:
            req.finish_released = True  # it never held KV (or gave it back on retract)
            return
        self.release(req)

    # --- release --------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Finish or abort (through `finish`): keep the page-aligned committed prefix in the cache, free the
        rest, unlock, free the row. Abort frees exactly like finish. A session turn that
        finished hands its KV to its session instead; one that was aborted (or failed) leaves
        the session as it was after its previous turn."""
        row = req.req_pool_idx
        assert row is not None, f"{req} has no row to release"
        if req.session_id is not None and self.sessions is not None:
            if req.finished_reason not in ("abort", "error"):
                self.sessions.save(req)
                return
            if self.sessions.owns_row(req):
                self.sessions.give_back(req, retract=False)
                return
            self.sessions.forget_turn(req)  # a first turn: released like any request
        slots = self.rows.req_to_token[row, : req.kv_allocated_len].clone()
        self._free_committed(req, slots)
        self.free_overallocated(req, slots)
        self.cache.dec_lock_ref(req.last_node)
        self.rows.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.finish_released = True

    def _free_committed(self, req: Req, slots: torch.Tensor) -> None:
        """Insert the aligned committed prefix (freeing duplicates already cached), then free
        the unaligned tail page."""
        committed, aligned = req.kv_committed_len, floor_align(req.kv_committed_len,
                                                               self.page_size)
        if self.prefix_sharing:
            already_cached = self.cache.insert(req.all_ids[:aligned], slots[:aligned])
            self.allocator.free_slots(slots[req.cache_protected_len : already_cached])
        else:
            self.allocator.free_slots(slots[req.cache_protected_len : aligned])
        self.allocator.free_slots(slots[aligned:committed])
        req.kv_committed_freed = True

    def free_overallocated(self, req: Req, slots: torch.Tensor) -> None:
        """Free over-allocation from the next page boundary: the tail page is already free,
        and freeing it again would put it in the free list twice."""
        committed, allocated = req.kv_committed_len, req.kv_allocated_len
        start = committed if self._overalloc_from_committed else ceil_align(committed,
                                                                            self.page_size)
        if allocated > start:
            self.allocator.free_slots(slots[start:allocated])
        req.kv_overallocated_freed = True

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk: cache the page-aligned committed prefix and lock it for the
        request; the unaligned tail stays with the request. Session turns are owned by their
        session, not the cache."""
        if not self.prefix_sharing or req.session_id is not None:
            return
        if not self.cache.caches_unfinished:
            return  # e.g. swa_radix: a lock on the prompt would pin its whole SWA KV
        row = req.req_pool_idx
        assert row is not None
        aligned = floor_align(req.kv_committed_len, self.page_size)
        if aligned <= req.cache_protected_len:
            return
        slots = self.rows.req_to_token[row, :aligned].clone()
        token_ids = req.all_ids[:aligned]
        already_cached = self.cache.insert(token_ids, slots)
        self.allocator.free_slots(slots[req.cache_protected_len : already_cached])
        match = self.cache.match_prefix(token_ids)
        assert match.length == aligned, (match.length, aligned)
        self.rows.write(row, req.cache_protected_len, match.slots[req.cache_protected_len :])
        self.cache.inc_lock_ref(match.node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.node
        req.cache_protected_len = aligned

    def retract(self, req: Req) -> None:
        """Out of memory: release the request's KV *without* caching it, keep its tokens, and
        reset its lengths so it is admitted afresh."""
        row = req.req_pool_idx
        assert row is not None
        if self._lent_session_row(req):
            assert self.sessions is not None
            self.sessions.give_back(req, retract=True)  # the session keeps what it had
        else:
            slots = self.rows.req_to_token[row, : req.kv_allocated_len].clone()
            # Its own slots: everything past the locked (page-aligned) prefix, whole pages.
            self.allocator.free_slots(slots[req.cache_protected_len :])
            self.cache.dec_lock_ref(req.last_node)
            self.rows.free(row)
        if not self._retract_keeps_lengths:
            req.reset_for_retract()
        req.is_retracted = True
        req.retract_count += 1
