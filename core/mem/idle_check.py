"""The memory check at idle: with no request left, every KV slot of every pool is free,
cached or held by a session, and every request row is free or session-held."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugserve.mem.manager import KVManager


def idle_memory_problems(kv: KVManager) -> list[str]:
    """Every reason the memory is not whole at idle (empty = whole). In every pool each KV
    slot is free, cached or held by a session, the cache locks nothing but open sessions'
    prefixes, no page is free twice; every request row is free or session-held. A real
    check (not `assert`): it holds under `python -O` too."""
    out: list[str] = []
    for pool in kv.pools:
        terms = pool.terms([])
        # Open streaming sessions keep their first turn's cached prefix locked between turns.
        session_locked = kv.session_locked_slots(pool.name)
        if terms.protected != session_locked:
            out.append(f"idle but {terms.protected} slots of pool {pool.name!r} are still "
                       f"locked by the cache ({session_locked} by open sessions)")
        if terms.balance != 0:
            out.append(f"KV leak at idle: {terms.describe()}")
        free_pages = pool.allocator.free_pages
        if len(free_pages) != len(set(free_pages)):
            out.append(f"a page of pool {pool.name!r} is in the free list twice")
    rows = kv.rows_problem()
    if rows is not None:
        out.append(f"idle but {rows}")
    return out
