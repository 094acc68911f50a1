"""Checks that once had holes: a cache-protected prefix that is not page-aligned, and the SWA
pool's protected term at idle while open streaming sessions hold cache locks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.cache.base import MatchResult
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.tiny_models import make_tiny_model_dir
from plugserve_checker.errors import KVLeakError

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
SHARED = [(7 * j) % 200 + 3 for j in range(40)]


class TestProtectedAlignment(EngineTest):
    env = {"PLUGSERVE_CACHE": "radix", "PLUGSERVE_PAGE_SIZE": "4"}

    def test_an_unaligned_match_is_named(self, tiny_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
        """A cache policy whose match is one slot short of a page boundary: the request's
        protected prefix is unaligned, and the checker says so (not only "off by")."""
        with self.engine(model=str(tiny_model_dir)) as engine:
            engine.generate([SHARED], PARAMS)
            cache = engine.kv.cache
            original = cache.match_prefix

            def short_match(token_ids: list[int]) -> MatchResult:
                match = original(token_ids)
                return MatchResult(match.slots[:-1], match.node) if match.length else match

            monkeypatch.setattr(cache, "match_prefix", short_match)
            with pytest.raises(KVLeakError, match=r"cache_protected_len \d+ is not a multiple "
                                                  r"of page_size 4"):
                engine.generate([[*SHARED, 9, 9]], PARAMS)

    def test_aligned_matches_pass(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            engine.generate([SHARED], PARAMS)
            (out,) = engine.generate([[*SHARED, 9, 9]], PARAMS)
            assert out.stats["cached_tokens"] == 40
            self.assert_idle_memory_whole(engine)


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("holes_swa"), arch="qwen3_swa", seed=4)


class TestSWAProtectedWithSessions(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session", "PLUGSERVE_PAGE_SIZE": "4"}

    def _session_holding_a_lock(self, engine: Any) -> str:
        engine.generate([SHARED], PARAMS)  # caches the shared prefix
        sid = str(engine.open_session())
        # The session's first turn matches the cached prefix and keeps it locked.
        (out,) = engine.generate([[*SHARED, 9, 9]], PARAMS, session_id=sid)
        assert out.stats["cached_tokens"] > 0
        assert engine.kv.session_locked_slots("swa") > 0
        return sid

    def test_session_locks_in_the_swa_pool_are_counted(self, swa_model: Path) -> None:
        with self.engine(model=str(swa_model)) as engine:
            assert [p.name for p in engine.kv.pools] == ["full", "swa"]
            sid = self._session_holding_a_lock(engine)
            engine.scheduler.settle_idle()  # the idle check, with the session's locks held
            self.assert_idle_memory_whole(engine)
            engine.close_session(sid)
            engine.scheduler.settle_idle()
            self.assert_idle_memory_whole(engine)

    def test_a_stray_swa_lock_is_caught_beside_session_locks(self, swa_model: Path) -> None:
        """SWA slots protected beyond what the sessions lock (the full pool balanced): the
        idle check used to skip the SWA pool whenever a session held a lock."""
        with self.engine(model=str(swa_model)) as engine:
            self._session_holding_a_lock(engine)
            cache: Any = engine.kv.cache
            stray = engine.config.page_size
            assert cache.swa_evictable_size() >= stray
            cache._swa_evictable -= stray  # what a leaked lock on a node's SWA side does
            cache._swa_protected += stray
            with pytest.raises(KVLeakError, match=r"pool 'swa': \d+ slots still locked by the "
                                                  r"cache at idle"):
                engine.scheduler.settle_idle()
