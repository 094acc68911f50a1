"""n > 1 and best_of on the engine: the prompt's KV is computed once and forked (the samples
lock their parent's cached prompt pages), every slot stays accounted (the checker at level 1
with page checks after every step), under the normal and the overlap loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.pools.allocator import floor_align
from plugserve.sampling import SamplingParams, sample_seed
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy

LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
PAGES = pytest.mark.parametrize("page", [1, 16])


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(11 * i + 5 + salt) % 240 + 3 for i in range(length)]


def _forked_prefill(prompt_len: int, n: int, page: int) -> int:
    """Prefill tokens when the parent computes the prompt and each other sample only what
    follows the full pages before its last token."""
    return prompt_len + (n - 1) * (prompt_len - floor_align(prompt_len - 1, page))


class TestNSamples(EngineTest):
    @LOOPS
    @PAGES
    def test_greedy_samples_equal_transformers_and_prefill_once(
        self, tiny_model_dir: Path, page: int, overlap: bool
    ) -> None:
        prompts = [_prompt(37), _prompt(20, salt=1)]
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True, n=3)
        with self.engine(model=str(tiny_model_dir), page_size=page, overlap=overlap) as engine:
            out = engine.generate(prompts, sp)
            computed = engine.stats()["prefill_tokens"]
            self.assert_idle_memory_whole(engine)
        ref = hf_greedy(tiny_model_dir, prompts, [6, 6])
        for res, want in zip(out, ref, strict=True):
            assert [s.token_ids for s in res.samples] == [want] * 3
            assert [s.sample_index for s in res.samples] == [0, 1, 2]
            assert res.token_ids == want
        assert computed == sum(_forked_prefill(len(p), 3, page) for p in prompts)
        # Every forked sample found the prompt's full pages cached.
        assert [s.stats["cached_tokens"] for s in out[0].samples] == [
            0, floor_align(36, page), floor_align(36, page)]

    @LOOPS
    def test_seeded_samples_equal_requests_run_one_by_one(
        self, tiny_model_dir: Path, overlap: bool
    ) -> None:
        prompt = _prompt(29)
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=1234, n=4)
        with self.engine(model=str(tiny_model_dir), page_size=4, overlap=overlap) as engine:
            together = engine.generate([prompt], sp)[0].samples
            again = engine.generate([prompt], sp)[0].samples
            alone = [engine.generate([prompt], SamplingParams(
                max_new_tokens=8, ignore_eos=True, temperature=1.0,
                seed=sample_seed(1234, j)))[0] for j in range(4)]
            self.assert_idle_memory_whole(engine)
        ids = [s.token_ids for s in together]
        assert ids == [r.token_ids for r in alone]
        assert ids == [s.token_ids for s in again]  # reproducible
        assert len({tuple(t) for t in ids}) == 4  # and different from each other

    def test_seed_derivation_wraps(self) -> None:
        assert sample_seed(None, 3) is None
        assert sample_seed(7, 2) == 9
        assert sample_seed((1 << 64) - 1, 1) == 0 - (1 << 63) + (1 << 63)  # wraps to 0

    @LOOPS
    def test_chunked_long_prompt_forks_after_the_last_chunk(
        self, tiny_model_dir: Path, overlap: bool
    ) -> None:
        prompt = _prompt(150)
        sp = SamplingParams(max_new_tokens=4, ignore_eos=True, n=3)
        with self.engine(model=str(tiny_model_dir), page_size=16, chunked_prefill_size=48,
                         overlap=overlap) as engine:
            out = engine.generate([prompt], sp)[0]
            computed = engine.stats()["prefill_tokens"]
            self.assert_idle_memory_whole(engine)
        want = hf_greedy(tiny_model_dir, [prompt], [4])[0]
        assert [s.token_ids for s in out.samples] == [want] * 3
        assert computed == _forked_prefill(150, 3, 16)

    @LOOPS
    def test_abort_one_sample_and_a_whole_request(
        self, tiny_model_dir: Path, overlap: bool
    ) -> None:
        sp = SamplingParams(max_new_tokens=30, ignore_eos=True, n=4)
        with self.engine(model=str(tiny_model_dir), page_size=4, overlap=overlap) as engine:
            one = engine.submit(_prompt(25), sp)
            whole = engine.submit(_prompt(18, salt=2), sp)
            waiting = engine.submit(_prompt(22, salt=3), sp)
            engine.abort(waiting.group[2])  # a sample still waiting for its parent's prompt
            for _ in range(4):
                engine.step()
            engine.abort(one.group[1])  # one running sample
            engine.abort(one)  # the parent: its forked samples keep its prompt pages locked
            for _ in range(3):
                engine.step()
            engine.abort_samples(whole)
            for _ in range(200):
                if not engine.step() and engine.is_idle():
                    break
            self.assert_idle_memory_whole(engine)
        assert [r.finished_reason for r in one.group] == ["abort", "abort", "length", "length"]
        assert all(r.finished_reason == "abort" for r in whole.group)
        assert [r.finished_reason for r in waiting.group] == ["length", "length", "abort",
                                                                "length"]
        assert [len(r.output_ids) for r in one.group[2:]] == [30, 30]

    @LOOPS
    @PAGES
    def test_retract_under_memory_pressure(
        self, tiny_model_dir: Path, page: int, overlap: bool
    ) -> None:
        prompts = [_prompt(20), _prompt(24, salt=4)]
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True, n=3)
        with self.engine(model=str(tiny_model_dir), page_size=page, overlap=overlap,
                         kv_pool_tokens=208) as engine:
            out = engine.generate(prompts, sp)
            assert engine.stats()["retracted_reqs"] > 0
            self.assert_idle_memory_whole(engine)
        ref = hf_greedy(tiny_model_dir, prompts, [40, 40])
        for res, want in zip(out, ref, strict=True):
            assert [s.token_ids for s in res.samples] == [want] * 3

    @LOOPS
    def test_mixed_chunk_with_staggered_arrivals(
        self, tiny_model_dir: Path, overlap: bool
    ) -> None:
        prompts = [_prompt(30), _prompt(45, salt=5), _prompt(12, salt=6)]
        sp = SamplingParams(max_new_tokens=10, ignore_eos=True, n=2)
        with self.engine(model=str(tiny_model_dir), page_size=4, overlap=overlap,
                         enable_mixed_chunk=True, chunked_prefill_size=16) as engine:
            first = engine.submit(prompts[0], sp)
            for _ in range(3):
                engine.step()
            later = [engine.submit(p, sp) for p in prompts[1:]]
            for _ in range(300):
                if not engine.step() and engine.is_idle():
                    break
            self.assert_idle_memory_whole(engine)
        ref = hf_greedy(tiny_model_dir, prompts, [10] * 3)
        for parent, want in zip([first, *later], ref, strict=True):
            assert [r.output_ids for r in parent.group] == [want, want]

    def test_prompt_logprobs_computed_once_given_to_every_sample(
        self, tiny_model_dir: Path
    ) -> None:
        prompt = _prompt(26)
        sp = SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=2)
        with self.engine(model=str(tiny_model_dir), page_size=4) as engine:
            alone = engine.generate([prompt], sp)[0]
            engine.kv.cache.evict(engine.kv.allocator.total_slots)
            before = engine.stats()["prefill_tokens"]
            out = engine.generate([prompt], SamplingParams(
                max_new_tokens=3, ignore_eos=True, prompt_logprobs=2, n=3))[0]
            computed = engine.stats()["prefill_tokens"] - before
            self.assert_idle_memory_whole(engine)
        assert computed == _forked_prefill(26, 3, 4)
        for s in out.samples:
            assert s.prompt_logprobs == alone.prompt_logprobs
            assert s.prompt_top_logprobs == alone.prompt_top_logprobs

    def test_more_samples_than_request_rows(self, tiny_model_dir: Path) -> None:
        """With one row the samples run one after another; a sample whose parent ended is
        admitted like any request (a prefix-cache hit on the prompt its parent released)."""
        prompt = _prompt(23)
        sp = SamplingParams(max_new_tokens=5, ignore_eos=True, n=3)
        with self.engine(model=str(tiny_model_dir), max_running_requests=1,
                         page_size=4) as engine:
            out = engine.generate([prompt], sp)[0]
            self.assert_idle_memory_whole(engine)
        assert [s.token_ids for s in out.samples] == hf_greedy(tiny_model_dir, [prompt], [5]) * 3
        assert [s.stats["cached_tokens"] for s in out.samples] == [0, 20, 20]

    def test_no_cache_every_sample_prefills(self, tiny_model_dir: Path) -> None:
        prompt = _prompt(33)
        sp = SamplingParams(max_new_tokens=3, ignore_eos=True, n=3)
        with self.engine(model=str(tiny_model_dir), cache="none") as engine:
            out = engine.generate([prompt], sp)[0]
            assert engine.stats()["prefill_tokens"] == 3 * 33
            self.assert_idle_memory_whole(engine)
        assert [s.token_ids for s in out.samples] == hf_greedy(tiny_model_dir, [prompt], [3]) * 3

    @LOOPS
    def test_best_of_returns_the_highest_cumulative_logprob(
        self, tiny_model_dir: Path, overlap: bool
    ) -> None:
        prompt = _prompt(21)
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5,
                            n=2, best_of=5)
        with self.engine(model=str(tiny_model_dir), overlap=overlap) as engine:
            res = engine.generate([prompt], sp)[0]
            every = engine.generate([prompt], SamplingParams(
                max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5, n=5,
                logprobs=True))[0].samples
            self.assert_idle_memory_whole(engine)
        ranked = sorted(every, key=lambda s: -(s.cumulative_logprob or 0.0))[:2]
        assert [s.token_ids for s in res.samples] == [s.token_ids for s in ranked]
        assert [s.sample_index for s in res.samples] == [0, 1]
        assert all(s.logprobs is None for s in res.samples)  # not asked for
        assert res.samples[0].cumulative_logprob is not None
        assert res.samples[0].cumulative_logprob >= res.samples[1].cumulative_logprob

    def test_stream_gives_each_sample_its_final_event(self, tiny_model_dir: Path) -> None:
        sp = SamplingParams(max_new_tokens=5, ignore_eos=True, n=3)
        with self.engine(model=str(tiny_model_dir)) as engine:
            events = list(engine.stream([_prompt(12), _prompt(14, salt=1)], sp))
            refused = list(engine.stream([_prompt(12)], SamplingParams(n=1, best_of=2)))
            self.assert_idle_memory_whole(engine)
        finals = [(e.index, e.sample_index) for e in events if e.finished]
        assert sorted(finals) == [(i, j) for i in range(2) for j in range(3)]
        for i in range(2):
            for j in range(3):
                toks = [t for e in events if (e.index, e.sample_index) == (i, j)
                        for t in e.token_ids]
                assert len(toks) == 5
        assert len(refused) == 1 and "cannot be streamed" in (refused[0].result.error or "")

    def test_invalid_counts_and_session_turns_are_refused(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir), cache="streaming_session") as engine:
            bad_n = engine.submit(_prompt(5), SamplingParams(n=0))
            bad_best = engine.submit(_prompt(5), SamplingParams(n=3, best_of=2))
            session = engine.open_session()
            turn = engine.submit(_prompt(5), SamplingParams(n=2), session_id=session)
            engine.close_session(session)
        assert "n must be an int >= 1, got 0" in (bad_n.error or "")
        assert "best_of must be None or an int >= n (3), got 2" in (bad_best.error or "")
        assert "streaming-session turn takes one sample" in (turn.error or "")


class TestNSamplesSlidingWindow(EngineTest):
    """A hybrid sliding-window model (two pools): `swa_radix` caches a prompt only at its
    request's end, so the samples do not fork: each prefills, every pool stays accounted."""

    @LOOPS
    def test_each_sample_prefills(self, tmp_path: Path, overlap: bool) -> None:
        from plugserve.testing.tiny_models import make_tiny_model_dir

        model = make_tiny_model_dir(tmp_path / "gemma3", arch="gemma3", seed=7)
        prompt = _prompt(40)
        sp = SamplingParams(max_new_tokens=20, ignore_eos=True, n=3)
        with self.engine(model=str(model), page_size=16, overlap=overlap) as engine:
            assert engine.config.cache == "swa_radix" and len(engine.kv.pools) == 2
            out = engine.generate([prompt], sp)[0]
            assert engine.stats()["prefill_tokens"] == 3 * 40
            self.assert_idle_memory_whole(engine)
        assert [s.token_ids for s in out.samples] == hf_greedy(model, [prompt], [20]) * 3
