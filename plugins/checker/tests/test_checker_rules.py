"""The checker's rules beyond the law itself: the freed-flags seed rule, nothing locked and
every row whole at idle; and a scheduler that cannot progress fails instead of spinning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.sched.scheduler import SchedulerStuckError
from plugserve.testing import EngineTest
from plugserve_checker.errors import KVLeakError

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(11 * j + 5 * i) % 200 + 3 for j in range(length)] for i in range(n)]


class TestFreedFlagsAgree(EngineTest):
    def test_a_half_release_is_reported(self, tiny_model_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """A release that frees the committed KV but never does its over-allocation half
        (here there is none to free, so no slot leaks): only the seed rule sees it."""
        with self.engine(model=str(tiny_model_dir)) as engine:
            monkeypatch.setattr(engine.kv, "free_overallocated", lambda req, slots: None)
            with pytest.raises(KVLeakError, match=r"committed KV freed=True but "
                                                  r"over-allocation freed=False"):
                engine.generate(_prompts(2, 8), PARAMS)

    def test_full_releases_pass(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            engine.generate(_prompts(2, 8), PARAMS)
            self.assert_idle_memory_whole(engine)


def _skip_one_unlock(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Test double: the cache forgets the first unlock of a real node."""
    cache = engine.kv.cache
    original = cache.dec_lock_ref
    skipped = {"done": False}

    def dec_lock_ref(node: Any) -> None:
        if not skipped["done"] and node is not None and node is not cache.root:
            skipped["done"] = True
            return
        original(node)

    monkeypatch.setattr(cache, "dec_lock_ref", dec_lock_ref)


class TestLeakedLock(EngineTest):
    env = {"PLUGSERVE_CACHE": "radix"}

    def test_the_idle_check_names_the_locked_slots(
        self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        shared = _prompts(1, 24)[0]
        with self.engine(model=str(tiny_model_dir)) as engine:
            engine.generate([shared], PARAMS)
            _skip_one_unlock(engine, monkeypatch)
            with pytest.raises(KVLeakError, match=r"pool 'full': \d+ slots still locked by the "
                                                  r"cache at idle"):
                engine.generate([[*shared, 9, 9, 9]], PARAMS)  # shares the cached prefix

    def test_a_stuck_scheduler_fails_clearly(
        self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With the checker off (it would report the lock at idle first), a request that
        needs the leaked slots makes the scheduler fail with a clear error, not spin."""
        shared = _prompts(1, 40)[0]
        with Engine(model=str(tiny_model_dir), cache="radix", kv_pool_tokens=64,
                    mem_check=0) as engine:
            engine.generate([shared], PARAMS)
            _skip_one_unlock(engine, monkeypatch)
            engine.generate([[*shared, 9]], PARAMS)  # locks the 40 cached slots for good
            assert engine.kv.cache.protected_size() > 0
            with pytest.raises(SchedulerStuckError, match=r"cannot make progress.*locked by "
                                                          r"the cache"):
                # A prompt that shares nothing and needs more than is left unlocked.
                engine.generate([[7] * 50], PARAMS)


class TestRowsWhole(EngineTest):
    def test_a_row_held_at_idle_is_reported(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            engine.generate(_prompts(1, 8), PARAMS)
            assert engine.kv.rows.alloc() is not None  # a row nobody will free
            with pytest.raises(KVLeakError, match=r"request rows not whole: free \d+ \+ "
                                                  r"session-held 0 != rows \d+"):
                engine.generate(_prompts(1, 8), PARAMS)
