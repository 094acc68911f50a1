"""KV lifecycle defects found in review and in a randomized soak, each pinned by a test.

Every test runs with the invariant checker at level 1 and physical page checks (EngineTest),
under the normal and the overlap loop.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from plugserve.engine import Engine
from plugserve.pools.allocator import floor_align
from plugserve.sampling import SamplingParams
from plugserve.structs.forward_batch import ForwardMode
from plugserve.testing import EngineTest


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(17 * i + 5 * salt) % 250 + 3 for i in range(n)]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])


class TestCachedTokens(EngineTest):
    @LOOPS
    @pytest.mark.parametrize("page_size", [1, 16])
    def test_a_repeated_prompt_reports_its_cached_prefix(
        self, tiny_model_dir: Path, page_size: int, overlap: bool
    ) -> None:
        prompt = _prompt(40)
        with self.engine(model=str(tiny_model_dir), page_size=page_size,
                         overlap=overlap) as engine:
            (first,) = engine.generate([prompt], _params(4))
            (again,) = engine.generate([prompt], _params(4))
            assert first.stats["cached_tokens"] == 0
            # The match leaves at least the last prompt token to compute, page-aligned.
            assert again.stats["cached_tokens"] == floor_align(len(prompt) - 1, page_size) > 0
            assert again.token_ids == first.token_ids
            self.assert_idle_memory_whole(engine)


class TestAbortChunkedInFlight(EngineTest):
    env = {"PLUGSERVE_CHUNKED_PREFILL_SIZE": "16"}

    @LOOPS
    def test_abort_stops_the_prompt_and_frees_like_a_finish(
        self, tiny_model_dir: Path, overlap: bool
    ) -> None:
        with self.engine(model=str(tiny_model_dir), overlap=overlap, page_size=4) as engine:
            sched = engine.scheduler
            long = engine.submit(_prompt(96), _params(8))
            assert sched.step()  # the first chunk runs (in flight under overlap)
            assert engine.abort(long)
            sched.run_until_idle()
            assert long.finished_reason == "abort" and long.output_ids == []
            # No further chunk ran for it: at most the chunk in flight at the abort.
            assert sched.stats["prefill_tokens"] <= 32
            assert long.retract_count == 0
            self.assert_idle_memory_whole(engine)
            (after,) = engine.generate([_prompt(20, salt=1)], _params(4))
            assert after.finish_reason == "length"
            self.assert_idle_memory_whole(engine)


class TestChunkKeepsTheDecodeReserve(EngineTest):
    """A long prompt's later chunks leave every running request room for its next decode."""

    env = {"PLUGSERVE_CHUNKED_PREFILL_SIZE": "16", "PLUGSERVE_CACHE": "none"}

    @LOOPS
    def test_running_decodes_keep_their_slot(self, tiny_model_dir: Path, overlap: bool) -> None:
        with self.engine(model=str(tiny_model_dir), overlap=overlap,
                         kv_pool_tokens=56) as engine:
            sched = engine.scheduler
            short = [engine.submit(_prompt(8, salt=i), _params(12)) for i in range(2)]
            engine.submit(_prompt(40, salt=7), _params(2))
            while sched.step():
                batch = sched.last_batch
                decoding = [r for r in sched.running_batch.reqs if not r.finished()]
                if batch is not None and batch.mode is ForwardMode.EXTEND and decoding:
                    free = engine.kv.allocator.available_size()
                    assert free >= len(decoding), (
                        f"a prefill chunk left {free} free slots for {len(decoding)} decodes"
                    )
            sched.settle_idle()
            assert all(r.finished_reason == "length" for r in short)
            # The three cannot all fit, so one retract may be needed; chunks that ate the
            # decodes' slots caused 11 on this workload.
            assert engine.stats().get("retracted_reqs", 0) <= 1
            self.assert_idle_memory_whole(engine)


class TestOverlapSoak(EngineTest):
    """Random waves through the public API on a small pool: retracts, aborts, chunks, mixed
    lengths. Each wave's greedy tokens must equal the normal loop's, and no wave may fail
    (e.g. a false "pool cannot hold even one running request")."""

    def _wave(self, engine: Engine, rng: random.Random) -> list[list[int]]:
        prompts = [_prompt(rng.randint(4, 60), salt=rng.randint(0, 50)) for _ in range(10)]
        params = [_params(rng.randint(1, 24)) for _ in prompts]
        reqs = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        aborted = rng.sample(range(len(reqs)), 2)
        abort_at = rng.randint(1, 6)
        steps = 0
        while engine.scheduler.step():
            steps += 1
            if steps == abort_at:
                for i in aborted:
                    engine.abort(reqs[i])
        engine.scheduler.settle_idle()
        self.assert_idle_memory_whole(engine)
        return [r.output_ids if i not in aborted else [] for i, r in enumerate(reqs)]

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_waves(self, tiny_model_dir: Path, page_size: int) -> None:
        outputs: dict[bool, list[list[list[int]]]] = {}
        for overlap in (False, True):
            rng = random.Random(page_size)
            with self.engine(model=str(tiny_model_dir), overlap=overlap, page_size=page_size,
                             kv_pool_tokens=160, chunked_prefill_size=32) as engine:
                outputs[overlap] = [self._wave(engine, rng) for _ in range(4)]
                assert engine.stats()["retracted_reqs"] > 0, "the small pool forces retracts"
        assert outputs[True] == outputs[False]


class TestOverlapReleasesBeforeRetract(EngineTest):
    """Overlap loop: a request that finished in the forward in flight gives its KV back only
    when that forward resolves. A decode short of memory must wait for it, not report that
    the pool "cannot hold even one running request" (found by a randomized soak)."""

    env = {"PLUGSERVE_CACHE": "none", "PLUGSERVE_CHUNKED_PREFILL_SIZE": "0"}

    @LOOPS
    def test_a_pool_that_fits_both_requests_in_turn(
        self, tiny_model_dir: Path, overlap: bool
    ) -> None:
        with self.engine(model=str(tiny_model_dir), overlap=overlap,
                         kv_pool_tokens=32) as engine:
            out = engine.generate([_prompt(6, salt=0), _prompt(10, salt=1)],
                                  [_params(8), _params(9)])
            assert [r.output_tokens for r in out] == [8, 9]
            assert all(r.error is None for r in out)
            self.assert_idle_memory_whole(engine)
