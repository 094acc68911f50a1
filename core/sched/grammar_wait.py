"""Requests whose grammar is still compiling wait in the queue; the others go ahead.

A constrained request is admitted only once the compile of its grammar (started at submit, on
the grammar service's own thread) is done: then it gets its `GrammarState`. A compile that
failed ends the request with the compiler's message, before it takes any KV.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, wait

from plugserve.grammar.state import GrammarState
from plugserve.structs.req import Req

# How long an otherwise idle scheduler blocks on a compile before looking at its queue again.
IDLE_COMPILE_WAIT_S = 0.05


def split_waiting(waiting: Iterable[Req]) -> tuple[list[Req], list[Req]]:
    """(requests that may be admitted now, requests whose grammar failed to compile)."""
    ready: list[Req] = []
    failed: list[Req] = []
    for req in waiting:
        future = req.grammar_future
        if future is None or req.grammar is not None:
            ready.append(req)
        elif future.done():
            exc = future.exception()
            if exc is not None:
                req.error = str(exc)
                failed.append(req)
            else:
                req.grammar = GrammarState(future.result())
                ready.append(req)
    return ready, failed


def wait_for_compiles(waiting: Iterable[Req]) -> bool:
    """Block briefly on the compiles the queue waits for; False when it waits for none."""
    pending = [r.grammar_future for r in waiting
               if r.grammar is None and r.grammar_future is not None
               and not r.grammar_future.done()]
    if not pending:
        return False
    wait(pending, timeout=IDLE_COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
    return True
