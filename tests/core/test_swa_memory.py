"""Hybrid sliding-window KV memory (two accounted pools): greedy output token-identical to
transformers fp32, SWA pages really freed, prefix reuse through swa_radix, retract and abort
under small pools, and one clear start-up error per bad setting.

The checker runs at level 1 with physical page checks (both pools) in every engine test.
The arch x page x cache x chunk x loop matrix (64 cases) is sampled deterministically: every
value of every axis appears for every arch, 5 cases per arch.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pydantic
import pytest

from plugserve.engine import Engine, EngineStartError
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts
from plugserve.testing.tiny_models import SLIDING_WINDOW_ARCHITECTURES, make_tiny_model_dir

VOCAB = 256


def _workload() -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(3, VOCAB, 50, 90, seed=21)
    prompts.append([*prompts[0][:40], 9, 8, 7])  # shares a 40-token prefix with prompt 0
    return prompts, [48, 20, 64, 30]


@functools.cache
def _model(arch: str, root: str) -> Path:
    return make_tiny_model_dir(Path(root) / arch, arch=arch, seed=7)


@functools.cache
def _reference(arch: str, root: str, key: str) -> list[list[int]]:
    prompts, max_new = _workload() if key == "workload" else _extra(key)
    return hf_greedy(_model(arch, root), prompts, max_new)


def _extra(key: str) -> tuple[list[list[int]], list[int]]:
    base = random_prompts(1, VOCAB, 64, 64, seed=31)[0]
    if key == "prefix":  # the second prompt continues the first: a reusable prefix
        return [base, [*base, *random_prompts(1, VOCAB, 30, 30, seed=32)[0]]], [1, 24]
    raise KeyError(key)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("swa_mem"))


PAGES, CACHES, CHUNKS, LOOPS = (1, 16), ("none", "swa_radix"), (0, 16), ("normal", "overlap")
_ALL = list(itertools.product(PAGES, CACHES, CHUNKS, LOOPS))
# 5 of the 16 combinations per arch, a different rotation for each arch: every value of every
# axis shows up for every arch.
MATRIX = [
    (arch, *_ALL[(a * 3 + i * 7) % len(_ALL)])
    for a, arch in enumerate(SLIDING_WINDOW_ARCHITECTURES)
    for i in range(5)
]


def _sampling(max_new: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]


class TestSWAGreedyMatchesTransformers(EngineTest):
    env = {"PLUGSERVE_ATTENTION": "torch_native"}

    @pytest.mark.parametrize(("arch", "page", "cache", "chunk", "loop"), MATRIX,
                             ids=["-".join(map(str, c)) for c in MATRIX])
    def test_greedy(self, arch: str, page: int, cache: str, chunk: int, loop: str,
                    root: str) -> None:
        expected = _reference(arch, root, "workload")
        prompts, max_new = _workload()
        with self.engine(model=str(_model(arch, root)), page_size=page, cache=cache,
                         chunked_prefill_size=chunk, overlap=loop == "overlap") as engine:
            kv = engine.kv
            assert [p.name for p in kv.pools] == ["full", "swa"]
            for _round in range(2):  # the second round starts from a warm cache
                results = engine.generate(prompts, _sampling(max_new))
                assert [r.error for r in results] == [None] * len(prompts)
                assert [r.token_ids for r in results] == expected
                self.assert_idle_memory_whole(engine)
            # SWA pages really fell out of the windows and were freed.
            assert kv.swa_window is not None and kv.swa_window.freed_slots > 0
            full, swa = (p.allocator for p in kv.pools)
            assert swa.peak_used_pages < full.peak_used_pages


    def test_mixed_chunk(self, root: str) -> None:
        expected = _reference("gemma3", root, "workload")
        prompts, max_new = _workload()
        with self.engine(model=str(_model("gemma3", root)), page_size=16,
                         chunked_prefill_size=16, enable_mixed_chunk=True,
                         overlap=True) as engine:
            results = engine.generate(prompts, _sampling(max_new))
            assert [r.token_ids for r in results] == expected
            self.assert_idle_memory_whole(engine)


class TestSWARadixReuse(EngineTest):
    def test_prefix_with_intact_window_is_reused(self, root: str) -> None:
        prompts, max_new = _extra("prefix")
        expected = _reference("qwen2_swa", root, "prefix")
        with self.engine(model=str(_model("qwen2_swa", root)), page_size=16,
                         chunked_prefill_size=16) as engine:
            assert engine.config.cache == "swa_radix"  # the default for a windowed model
            first = engine.generate([prompts[0]], _sampling(max_new[:1]))[0]
            second = engine.generate([prompts[1]], _sampling(max_new[1:]))[0]
            assert [first.token_ids, second.token_ids] == expected
            assert second.stats["cached_tokens"] == 64
            self.assert_idle_memory_whole(engine)

    def test_tombstoned_window_is_not_matched(self, root: str) -> None:
        prompts, max_new = _extra("prefix")
        expected = _reference("qwen2_swa", root, "prefix")
        with self.engine(model=str(_model("qwen2_swa", root)), page_size=16) as engine:
            engine.generate([prompts[0]], _sampling(max_new[:1]))
            cache = engine.kv.cache
            assert cache.swa_evictable_size() > 0
            cache.evict_swa(cache.swa_evictable_size())  # tombstone every SWA page
            assert cache.swa_evictable_size() == 0 and cache.evictable_size() == 64
            self.assert_idle_memory_whole(engine)
            second = engine.generate([prompts[1]], _sampling(max_new[1:]))[0]
            assert second.token_ids == expected[1]
            assert second.stats["cached_tokens"] == 0
            self.assert_idle_memory_whole(engine)


class TestSWASmallPools(EngineTest):
    @pytest.mark.parametrize("loop", ["normal", "overlap"])
    def test_retract_under_small_pools(self, loop: str, root: str) -> None:
        expected = _reference("gemma3", root, "workload")
        prompts, max_new = _workload()
        with self.engine(model=str(_model("gemma3", root)), page_size=16, cache="swa_radix",
                         chunked_prefill_size=16, overlap=loop == "overlap",
                         kv_pool_tokens=256, swa_pool_tokens=160) as engine:
            results = engine.generate(prompts, _sampling(max_new))
            assert [r.token_ids for r in results] == expected
            assert engine.stats().get("retracted_reqs", 0) > 0
            self.assert_idle_memory_whole(engine)

    def test_abort_mid_decode(self, root: str) -> None:
        prompts, max_new = _workload()
        with self.engine(model=str(_model("qwen3_swa", root)), page_size=16,
                         chunked_prefill_size=16, overlap=True) as engine:
            reqs = [engine.submit(p, s) for p, s in zip(prompts, _sampling(max_new),
                                                         strict=True)]
            for _ in range(30):
                engine.scheduler.step()
            assert engine.kv.swa_window is not None and engine.kv.swa_window.freed_slots > 0
            engine.abort(reqs[2])
            engine.abort(reqs[0])
            engine.scheduler.run_until_idle()
            assert reqs[2].finished_reason == "abort"
            assert reqs[1].finished_reason == "length"
            self.assert_idle_memory_whole(engine)


class TestSWAStartErrors:
    def test_swa_pool_tokens_not_positive(self) -> None:
        with pytest.raises(pydantic.ValidationError, match="swa_pool_tokens must be a positive"):
            Engine(swa_pool_tokens=0)

    def test_swa_pool_too_small_for_a_window(self, root: str) -> None:
        with pytest.raises(EngineStartError,
                           match=r"swa_pool_tokens=20 cannot hold one request's sliding window"
                                 r".*at least 64 slots"):
            Engine(model=str(_model("gemma3", root)), page_size=16, swa_pool_tokens=20)

    def test_plain_radix_refused_for_a_windowed_model(self, root: str) -> None:
        with pytest.raises(EngineStartError) as info:
            Engine(model=str(_model("mistral_swa", root)), cache="radix")
        assert "cache policy 'radix' does not support sliding windows" in str(info.value)
        assert "swa_radix" in str(info.value)

    def test_one_full_pool_when_switched_off(self, root: str) -> None:
        with Engine(model=str(_model("gemma3", root)), swa_pools=False) as engine:
            assert [p.name for p in engine.kv.pools] == ["full"]
            assert engine.kv.swa_window is None
