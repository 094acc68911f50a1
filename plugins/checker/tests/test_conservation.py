"""The checker proves conservation at every step, for every term, and catches planted leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine, EngineStoppedError
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve_checker.errors import KVLeakError

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def _checker(engine: Engine) -> Any:
    (checker,) = engine.checkers
    return checker


def _prompts(n: int, length: int, shared: int = 0) -> list[list[int]]:
    base = [(7 * i) % 200 + 3 for i in range(shared)]
    return [base + [(11 * j + 5 * i) % 200 + 3 for j in range(length)] for i in range(n)]


class TestEveryTerm(EngineTest):
    @pytest.mark.parametrize("cache", ["radix", "none"])
    @pytest.mark.parametrize("page_size", [1, 16])
    def test_terms_seen_and_law_held(self, tiny_model_dir: Path, page_size: int,
                                     cache: str) -> None:
        with self.engine(model=str(tiny_model_dir), page_size=page_size, cache=cache,
                         chunked_prefill_size=32, kv_pool_tokens=384,
                         mem_check_ring_size=100_000) as engine:
            sched = engine.scheduler
            # Round 1 warms the cache; round 2 shares prefixes, chunks, decodes, retracts and
            # aborts while the checker runs after every step.
            engine.generate(_prompts(2, 40, shared=48), GREEDY)
            reqs = [engine.submit(p, SamplingParams(max_new_tokens=40, ignore_eos=True))
                    for p in _prompts(6, 30, shared=48)]
            reqs.append(engine.submit(_prompts(1, 90)[0], GREEDY))  # chunked (> 32 tokens)
            steps = 0
            while sched.step():
                steps += 1
                if steps == 6:
                    assert engine.abort(reqs[1])  # aborted mid-decode
            sched.settle_idle()
            terms = [t for _, phase, ts in _checker(engine).ring if phase == "busy" for t in ts]
            assert terms and all(t.balance == 0 for t in terms)
            assert any(t.uncached > 0 for t in terms)
            assert reqs[1].finished_reason == "abort"
            if cache == "radix":
                assert any(t.protected > 0 for t in terms), "shared prefixes were locked"
                assert any(t.evictable > 0 for t in terms), "finished prefixes were cached"
            else:
                assert all(t.protected == 0 and t.evictable == 0 for t in terms)
            assert engine.stats()["retracted_reqs"] > 0, "the small pool forces retracts"
            self.assert_idle_memory_whole(engine)


def _drop_one_page_on_free(engine: Engine, after_frees: int) -> dict[str, int]:
    """Test double: the allocator forgets one page on its `after_frees`-th free."""
    allocator = engine.kv.allocator
    original = allocator.free_slots
    seen = {"frees": 0, "dropped_at_step": -1}

    def leaky_free(slots: Any) -> None:
        seen["frees"] += 1
        before = len(allocator.free_pages)
        original(slots)
        if seen["frees"] == after_frees and len(allocator.free_pages) > before:
            allocator.free_pages.pop()
            seen["dropped_at_step"] = int(engine.scheduler.stats["steps"]) + 1

    allocator.free_slots = leaky_free  # type: ignore[method-assign]
    return seen


class TestPlantedLeak(EngineTest):
    @pytest.mark.parametrize("level", [1, 2])
    def test_caught_at_first_step(self, tiny_model_dir: Path, level: int,
                                  caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level("INFO", logger="plugserve.checker")
        with self.engine(model=str(tiny_model_dir), mem_check=level, cache="none",
                         mem_check_ring_size=8) as engine:
            seen = _drop_one_page_on_free(engine, after_frees=1)
            prompts = _prompts(3, 10)
            params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 12, 12)]
            with pytest.raises(KVLeakError) as info:
                engine.generate(prompts, params)
            message = str(info.value)
            assert f"after step {seen['dropped_at_step']} " in message
            assert "pool 'full'" in message and "off by -1" in message
            for term in ("available", "evictable", "protected", "session_held", "uncached"):
                assert term in message
            ring = _checker(engine).ring
            assert len(ring) == min(8, seen["dropped_at_step"] + 1)  # the steps before it
            assert f"step {seen['dropped_at_step'] - 1} busy" in message
            with pytest.raises(EngineStoppedError):
                engine.generate(prompts[:1], params[0])
            logged = [r for r in caplog.records if r.name == "plugserve.checker"]
            assert (len(logged) > 0) == (level == 2)


class TestLevels(EngineTest):
    def test_level_zero_builds_no_checker(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir), mem_check=0) as engine:
            _drop_one_page_on_free(engine, after_frees=1)
            engine.generate(_prompts(2, 8), SamplingParams(max_new_tokens=4, ignore_eos=True))
            assert engine.checkers == []  # nothing runs, so nothing costs

    def test_ring_is_bounded(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir), mem_check_ring_size=4) as engine:
            engine.generate(_prompts(3, 8), SamplingParams(max_new_tokens=20, ignore_eos=True))
            checker = _checker(engine)
            assert checker.steps_checked > 4
            assert len(checker.ring) == 4
            assert engine.stats()["checker"]["steps_checked"] == checker.steps_checked
