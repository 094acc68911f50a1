"""Sliding-window (hybrid SWA pool) fix toggles: each old behaviour fails its test, the fixed
code passes the same test.

- swa_uncached_from_protected: a request's SWA uncached slots counted from
  cache_protected_len alone; the checker reports the pages it freed out of the window as
  counted twice (a false leak).
- swa_evict_partial_page: window eviction frees the page the window still reads; the
  windowed layers read the padding page instead: tokens differ from transformers.
- swa_match_across_tombstone: swa_radix matches a prefix whose last window was tombstoned;
  the request reads the padding page for it: tokens differ from transformers.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts
from plugserve.testing.tiny_models import make_tiny_model_dir
from plugserve_checker.errors import KVLeakError

PROMPTS = random_prompts(2, 256, 40, 70, seed=41)
MAX_NEW = [56, 40]
BASE = random_prompts(1, 256, 64, 64, seed=42)[0]
PREFIX_PROMPTS = [BASE, [*BASE, *random_prompts(1, 256, 6, 6, seed=43)[0]]]  # window reads the tombstones
PREFIX_NEW = [1, 24]


def _params(max_new: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]


@functools.cache
def _model(root: str) -> Path:
    return make_tiny_model_dir(Path(root) / "qwen2_swa", arch="qwen2_swa", seed=3)


@functools.cache
def _reference(root: str, prefix: bool) -> list[list[int]]:
    if prefix:
        return hf_greedy(_model(root), PREFIX_PROMPTS, PREFIX_NEW)
    return hf_greedy(_model(root), PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("swa_toggles"))


class SWAToggle(EngineTest):
    env = {"PLUGSERVE_PAGE_SIZE": "16", "PLUGSERVE_CHUNKED_PREFILL_SIZE": "16"}

    def engine_for(self, root: str) -> Engine:
        return self.engine(model=str(_model(root)))


class TestSWAUncachedFromProtected(SWAToggle):
    def _run(self, engine: Engine, root: str) -> None:
        out = engine.generate(PROMPTS, _params(MAX_NEW))
        assert [r.token_ids for r in out] == _reference(root, False)
        self.assert_idle_memory_whole(engine)

    def test_fixed(self, root: str) -> None:
        with self.engine_for(root) as engine:
            self._run(engine, root)

    def test_reverted_fails(self, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "swa_uncached_from_protected")
        with self.engine_for(root) as engine:
            with pytest.raises(KVLeakError, match=r"pool 'swa': .*\(off by \+\d+\)"):
                self._run(engine, root)


class TestSWAEvictPartialPage(SWAToggle):
    def _tokens(self, engine: Engine) -> list[list[int]]:
        out = engine.generate(PROMPTS, _params(MAX_NEW))
        self.assert_idle_memory_whole(engine)  # the accounting is right: only tokens differ
        return [r.token_ids for r in out]

    def test_fixed(self, root: str) -> None:
        with self.engine_for(root) as engine:
            assert self._tokens(engine) == _reference(root, False)

    def test_reverted_fails(self, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "swa_evict_partial_page")
        with self.engine_for(root) as engine:
            assert self._tokens(engine) != _reference(root, False)


class TestSWAMatchAcrossTombstone(SWAToggle):
    def _second_after_tombstones(self, engine: Engine) -> list[int]:
        engine.generate([PREFIX_PROMPTS[0]], _params(PREFIX_NEW[:1]))
        cache = engine.kv.cache
        cache.evict_swa(cache.swa_evictable_size())  # tombstone every cached SWA page
        out = engine.generate([PREFIX_PROMPTS[1]], _params(PREFIX_NEW[1:]))[0]
        self.assert_idle_memory_whole(engine)
        return out.token_ids

    def test_fixed(self, root: str) -> None:
        with self.engine_for(root) as engine:
            assert self._second_after_tombstones(engine) == _reference(root, True)[1]

    def test_reverted_fails(self, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "swa_match_across_tombstone")
        with self.engine_for(root) as engine:
            assert self._second_after_tombstones(engine) != _reference(root, True)[1]
