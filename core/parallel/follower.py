"""A rank > 0: the same engine as rank 0's, driven by rank 0's commands instead of requests.

`run_follower_rank` builds the engine (its shard of the model, its KV pools, the same
scheduler) and then loops: receive rank 0's message, make the recorded changes to the
scheduler exactly as rank 0 made them (`apply`), make the same scheduler call. It returns
when rank 0 closes; an error (a leak its checker found, a collective that failed because
another rank went away) ends the process with that error.

Under torchrun every rank runs the same command; the CLI hands ranks > 0 to
`Engine.run_follower` before doing anything else. A script under torchrun does the same:

    from plugserve.parallel import is_follower_rank
    if is_follower_rank():
        Engine.run_follower(config)   # returns when rank 0 closes its engine
    else:
        with Engine(config) as engine: ...
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from plugserve.parallel.channel import CLOSE, IDLE, OP_NAMES, STEP
from plugserve.structs.req import Req

if TYPE_CHECKING:
    from plugserve.config import EngineConfig

log = logging.getLogger("plugserve.parallel")


def run_follower_rank(engine_cls: Any, config: EngineConfig, plugins: Sequence[str] = ()) -> None:
    """Build this rank's engine (`engine_cls(config, plugins=...)`) and follow rank 0 until it
    closes."""
    try:
        engine = engine_cls(config, plugins=plugins)
    except Exception:
        log.exception("this tensor-parallel rank could not start")
        raise
    try:
        follow(engine)
    except Exception:
        log.exception("tensor-parallel rank %s stops", engine.tp.rank if engine.tp else "?")
        raise
    finally:
        engine.close()


def follow(engine: Any) -> None:
    tp = engine.tp
    sched = engine.scheduler
    while True:
        op, commands = tp.channel.receive()
        for command in commands:
            apply(engine, command)
        if op == STEP:
            sched.step()
        elif op == IDLE:
            sched.settle_idle()
        elif op == CLOSE:
            return
        else:
            raise RuntimeError(f"unknown command {op} from rank 0 (known: {OP_NAMES})")


def apply(engine: Any, command: tuple[Any, ...]) -> None:
    """Make one change rank 0 made to its scheduler's work, the way it made it."""
    kind, *args = command
    if kind == "submit":
        rid, ids, sampling, session_id, session_offset = args
        req = Req(rid, ids, sampling, session_id=session_id)
        if session_id is not None:
            engine.kv.sessions.begin_turn(req, session_offset)
        engine.scheduler.add_request(req)
    elif kind == "abort":
        engine.scheduler.abort(args[0])
    elif kind == "open_session":
        timeout_s, session_id = args
        engine.kv.sessions.store.open(timeout_s, session_id)  # under rank 0's id
    elif kind == "close_session":
        engine.kv.sessions.close(args[0])
    elif kind == "reset_cache":
        engine.kv.cache.reset()
    else:
        raise RuntimeError(f"unknown command {kind!r} from rank 0")
