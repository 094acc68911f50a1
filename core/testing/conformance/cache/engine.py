"""Engine-level cache suite: whole generations with the policy under test on tiny random
models, greedy output token-identical to transformers fp32, the invariant checker at level 1
with physical page checks (`plugserve.testing.EngineTest`) and memory whole at idle after
every call. Only the public `Engine` API is used."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from plugserve.testing.conformance.cache.base import CacheConformanceTest
from plugserve.testing.conformance.cache.workloads import (
    SESSION_TURNS,
    WINDOWED_ARCH,
    hf_reference,
    hf_session_reference,
    workload,
)
from plugserve.testing.conformance.generations import (
    assert_checked_and_whole,
    assert_tokens,
    generate_greedy,
    greedy,
)
from plugserve.testing.conformance.requirements import requires
from plugserve.testing.engine_test import EngineTest

__all__ = ["TestCacheEngine", "TestCacheEngineSessions", "TestCacheEngineSlidingWindow"]

PAGES = pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])


@functools.cache
def windowed_model_dir(root: str) -> Path:
    from plugserve.testing.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(Path(root) / "cache_conformance_windowed", arch=WINDOWED_ARCH,
                               seed=3)


class CacheEngineTest(CacheConformanceTest, EngineTest):
    def policy_engine(self, model_dir: Path, **overrides: Any) -> Any:
        return self.engine(model=str(model_dir), cache=self.target.name, dtype="float32",
                           device="cpu", **overrides)

    def generate_rounds(self, engine: Any, model_dir: Path, kind: str,
                        rounds: int) -> list[list[Any]]:
        """`rounds` calls of the workload (the second starts from a warm cache), each equal
        to transformers and leaving memory whole."""
        prompts, max_new = workload(kind)
        expected = hf_reference(str(model_dir), kind)
        out = []
        for i in range(rounds):
            results = generate_greedy(engine, prompts, max_new)
            assert_tokens([r.token_ids for r in results], expected,
                          f"cache policy {self.target.name!r}, round {i + 1}: greedy output "
                          "differs from transformers fp32")
            assert_checked_and_whole(engine)
            out.append(results)
        return out

    def assert_sharing(self, results: list[Any], page_size: int) -> None:
        """Cached prompt tokens are whole pages, below the prompt's length, and there are
        some exactly when the policy shares prefixes."""
        cached = [int(r.stats["cached_tokens"]) for r in results]
        for r, n in zip(results, cached, strict=True):
            assert n % page_size == 0 and 0 <= n < r.prompt_tokens, (n, r.prompt_tokens)
        if self.target.capabilities.prefix_sharing:
            assert sum(cached) > 0, "a second round of the same prompts reused no cached KV"
        else:
            assert sum(cached) == 0, "a policy without prefix sharing reported cached tokens"


class TestCacheEngine(CacheEngineTest):
    """Normal and overlap loops, chunked prefill with mixed chunks, retracts and evictions."""

    @PAGES
    @LOOPS
    def test_greedy_and_prefix_reuse(self, page_size: int, overlap: bool,
                                     tiny_model_dir: Path) -> None:
        with self.policy_engine(tiny_model_dir, page_size=page_size, overlap=overlap) as engine:
            rounds = self.generate_rounds(engine, tiny_model_dir, "shared", rounds=2)
        self.assert_sharing(rounds[1], page_size)

    @PAGES
    def test_chunked_prefill_and_mixed_chunk(self, page_size: int,
                                             tiny_model_dir: Path) -> None:
        with self.policy_engine(tiny_model_dir, page_size=page_size, chunked_prefill_size=16,
                                enable_mixed_chunk=True) as engine:
            self.generate_rounds(engine, tiny_model_dir, "shared", rounds=2)

    @PAGES
    @LOOPS
    def test_retract_and_evict_on_a_small_pool(self, page_size: int, overlap: bool,
                                               tiny_model_dir: Path) -> None:
        with self.policy_engine(tiny_model_dir, page_size=page_size, overlap=overlap,
                                kv_pool_tokens=128) as engine:
            self.generate_rounds(engine, tiny_model_dir, "long", rounds=2)
            retracted = engine.stats()["retracted_reqs"]
        assert retracted > 0, "the 128-slot pool was meant to force retracts"

    @PAGES
    @LOOPS
    def test_n_samples_fork_the_prompt(self, page_size: int, overlap: bool,
                                       tiny_model_dir: Path) -> None:
        """n = 3 per prompt: every sample equals transformers; with a policy that caches a
        running request's prompt the samples fork it (their cached tokens are the whole
        pages before the last prompt token), and the checker holds after every step."""
        from dataclasses import replace

        prompts, max_new = workload("shared")
        expected = hf_reference(str(tiny_model_dir), "shared")
        with self.policy_engine(tiny_model_dir, page_size=page_size, overlap=overlap) as engine:
            results = engine.generate(prompts, [replace(sp, n=3) for sp in greedy(max_new)])
            assert_checked_and_whole(engine)
        forks = self.target.capabilities.prefix_sharing and engine.kv.forks.enabled
        forked = 0
        for r, want, prompt in zip(results, expected, prompts, strict=True):
            assert r.error is None, r.error
            assert_tokens([s.token_ids for s in r.samples], [want] * 3,
                          f"cache policy {self.target.name!r}, n=3: a sample differs from "
                          "transformers fp32")
            shared = (len(prompt) - 1) // page_size * page_size
            cached = [int(s.stats["cached_tokens"]) for s in r.samples[1:]]
            assert all(n % page_size == 0 and n < len(prompt) for n in cached), cached
            forked += shared > 0 and cached == [shared] * 2
        # A policy may hold less than a running prompt (a bound): then the samples wait for
        # the parent's end and match what is left. Some must fork all the same.
        if forks:
            assert forked > 0, (f"cache policy {self.target.name!r}: no sample forked its "
                                "parent's cached prompt")


class TestCacheEngineSessions(CacheEngineTest):
    """Streaming sessions on the policy: two conversations interleaved, one rewinding; every
    turn equals transformers on the whole conversation; memory whole with sessions open and
    after they close."""

    def run_sessions(self, engine: Any, model_dir: Path) -> None:
        expected = {s: hf_session_reference(str(model_dir), s) for s in SESSION_TURNS}
        # A plain request first: session a's first turn then shares its prefix through the
        # cache and keeps that lock between turns (what path_size must count at idle).
        first_ids, first_new, _ = SESSION_TURNS["a"][0]
        (plain,) = generate_greedy(engine, [first_ids], [first_new])
        assert_tokens([plain.token_ids], [expected["a"][0]], "a plain request before sessions")
        sessions = {script: engine.open_session() for script in SESSION_TURNS}
        for turn in range(3):
            for script, sid in sessions.items():
                new_ids, max_new, offset = SESSION_TURNS[script][turn]
                (result,) = generate_greedy(engine, [new_ids], [max_new], session_id=sid,
                                            session_offset=offset)
                assert_tokens([result.token_ids], [expected[script][turn]],
                              f"cache policy {self.target.name!r}, session {script} turn "
                              f"{turn + 1}: differs from transformers on the conversation")
                if turn and offset is None:
                    assert result.stats["cached_tokens"] > 0, "a later turn reused nothing"
                if not turn and script == "a" and self.target.capabilities.prefix_sharing:
                    assert result.stats["cached_tokens"] > 0, (
                        "a first turn did not share the cached prefix of the same prompt")
                assert_checked_and_whole(engine)
        for sid in sessions.values():
            engine.close_session(sid)
        assert_checked_and_whole(engine)

    @requires("sessions")
    @PAGES
    @LOOPS
    def test_sessions(self, page_size: int, overlap: bool, tiny_model_dir: Path) -> None:
        with self.policy_engine(tiny_model_dir, page_size=page_size, overlap=overlap) as engine:
            self.run_sessions(engine, tiny_model_dir)

    @requires("sessions", "sliding_window")
    def test_sessions_on_a_sliding_window_model(
        self, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        model_dir = windowed_model_dir(str(tmp_path_factory.getbasetemp()))
        with self.policy_engine(model_dir, page_size=4) as engine:
            self.run_sessions(engine, model_dir)


class TestCacheEngineSlidingWindow(CacheEngineTest):
    """A hybrid sliding-window model (full and SWA pools): both laws, prefix reuse where the
    window is intact, a small SWA pool that evicts."""

    @requires("sliding_window")
    @pytest.mark.parametrize("page_size", [1, 4], ids=lambda p: f"page{p}")
    @LOOPS
    def test_sliding_window_model(self, page_size: int, overlap: bool,
                                  tmp_path_factory: pytest.TempPathFactory) -> None:
        model_dir = windowed_model_dir(str(tmp_path_factory.getbasetemp()))
        with self.policy_engine(model_dir, page_size=page_size, overlap=overlap,
                                chunked_prefill_size=16) as engine:
            self.generate_rounds(engine, model_dir, "windowed", rounds=2)
            pools = set(engine.stats()["kv_pools"])
        assert pools == {"full", "swa"}, f"expected a full and a SWA pool, got {sorted(pools)}"

    @requires("sliding_window")
    def test_small_sliding_window_pool(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        model_dir = windowed_model_dir(str(tmp_path_factory.getbasetemp()))
        with self.policy_engine(model_dir, page_size=4, chunked_prefill_size=16,
                                swa_pool_tokens=160) as engine:
            self.generate_rounds(engine, model_dir, "windowed", rounds=2)
