"""SampleFork: the samples of an n > 1 request share their parent's prompt KV.

The parent (sample 0) is admitted and prefills like any request; after its prefill the
scheduler caches its page-aligned prompt as unfinished, and the parent locks it. A sample
then *forks*: it takes a row, matches the same cached pages and takes its own lock on them
(the lock is the reference count: the pages stay locked until the last of the group ends),
and computes only the rest of its prompt, at least the last token, whose logits it samples
from. Nothing is copied, so no KV copy has to be ordered against a forward in flight (the
overlap loop); with page size P a sample computes at most P prompt tokens again.

Accounting: no new owner kind. The shared pages are the cache's `protected` slots, counted
once whoever holds them; each sample counts `ceil_align(allocated) - cache_protected_len`
as `uncached` like any request. Its release inserts its prompt like any other (the shared
pages are found already cached, its own copy of the last page is freed as a duplicate).

Without sharing (cache `none`, or `swa_radix` with a SWA pool, which caches a prompt only at
its request's end) samples do not wait or fork: each prefills its whole prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plugserve.fixes import FixToggle
from plugserve.pools.allocator import floor_align
from plugserve.structs.req import Req

if TYPE_CHECKING:
    from plugserve.mem.manager import KVManager

FORK_WITHOUT_LOCK = FixToggle(
    "fork_without_lock",
    "fork a sample onto its parent's cached prompt pages without taking the cache lock",
)


class SampleFork:
    def __init__(self, kv: KVManager, *, without_lock: bool = False) -> None:
        self.kv = kv
        self._without_lock = without_lock

    @property
    def enabled(self) -> bool:
        """Whether samples share their parent's prompt (the cache keeps a running request's
        prompt); otherwise each prefills."""
        return self.kv.prefix_sharing and self.kv.cache.caches_unfinished

    def shared_len(self, req: Req) -> int:
        """Prompt positions a sample takes from its parent: the full pages before the last
        prompt token. 0 for a parent, a sample that already generated (it was retracted: it
        is admitted again like any request) and without sharing."""
        if req.fork_parent is None or req.output_ids or not self.enabled:
            return 0
        return floor_align(len(req.origin_input_ids) - 1, self.kv.page_size)

    def pending(self, req: Req) -> bool:
        """A sample waits while its parent's prompt is not cached yet (the parent waits, is
        mid-prefill, or its prefill's results are not in). A parent that ended released its
        prompt into the cache: the sample is admitted like any request then."""
        parent, shared = req.fork_parent, self.shared_len(req)
        if parent is None or shared == 0 or parent.finished():
            return False
        return not _parent_locks(parent, shared)

    def can_fork(self, req: Req) -> bool:
        shared = self.shared_len(req)
        parent = req.fork_parent
        return (shared > 0 and parent is not None and req.req_pool_idx is None
                and self.kv.rows.available_rows() > 0 and _parent_locks(parent, shared))

    def fork(self, req: Req) -> None:
        kv, parent, shared = self.kv, req.fork_parent, self.shared_len(req)
        assert parent is not None and parent.req_pool_idx is not None
        match = kv.cache.match_prefix(req.origin_input_ids[:shared])
        parent_slots = kv.rows.req_to_token[parent.req_pool_idx, :shared]
        if match.length != shared or not torch.equal(match.slots.to(parent_slots.device),
                                                     parent_slots):
            raise RuntimeError(f"fork of {req}: the cache holds {match.length} of the "
                               f"{shared} prompt positions its parent {parent} locks")
        row = kv.rows.alloc()
        assert row is not None, "fork without a free row: can_fork first"
        req.req_pool_idx, req.is_retracted, req.last_node = row, False, match.node
        if not self._without_lock:
            kv.cache.inc_lock_ref(match.node)
        kv.rows.write(row, 0, match.slots)
        req.cache_protected_len = req.kv_committed_len = req.kv_allocated_len = shared
        if req.retract_count == 0:
            req.cached_tokens = shared


def _parent_locks(parent: Req, shared: int) -> bool:
    """The parent runs with at least `shared` prompt positions cached and locked."""
    return (parent.req_pool_idx is not None and not parent.finished()
            and parent.is_chunked == 0 and parent.cache_protected_len >= shared)
