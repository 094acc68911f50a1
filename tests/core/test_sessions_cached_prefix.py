"""A session whose first turn matches a cached prefix keeps that prefix locked between turns
(`SessionSlot.last_node`, `cache_protected_len`): the slot owns the lock, as DESIGN.md §6
intends. The idle rules (the checker's and `assert_memory_whole`) allow exactly the slots
open sessions lock, no more (found by `plugserve bench sessions`, whose first turns once
stopped the engine with a false "still locked at idle").
"""

from __future__ import annotations

from pathlib import Path

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest


class TestFirstTurnOnACachedPrefix(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session"}

    def test_idle_with_an_open_session_on_a_cached_prefix(self, tiny_model_dir: Path) -> None:
        sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir)) as engine:
            engine.generate([[5, 6, 7, 8, 9, 10]], sp)  # now cached in the radix tree
            sid = engine.open_session()
            (out,) = engine.generate([[5, 6, 7, 8, 9, 10, 11]], sp, session_id=sid)
            assert out.finish_reason == "length" and out.stats["cached_tokens"] > 0
            self.assert_idle_memory_whole(engine)
            other = engine.open_session()  # a second session locks the same nodes: once
            engine.generate([[5, 6, 7, 8, 9, 10, 3]], sp, session_id=other)
            (out,) = engine.generate([[12, 13]], sp, session_id=sid)
            assert out.finish_reason == "length"
            self.assert_idle_memory_whole(engine)
            engine.close_session(other)
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)
