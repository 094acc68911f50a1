"""Greedy output token-identical to HF transformers across the scheduler/memory matrix."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts
from plugserve.testing.tiny_models import make_tiny_model_dir

VOCAB = 256


def _workload(long_decodes: bool = False) -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(6, VOCAB, 3, 40, seed=1)
    prompts.append([*prompts[0][:20], 7, 8, 9])  # shares a prefix with prompt 0
    max_new = [12, 5, 20, 9, 16, 1, 14]
    if long_decodes:  # many requests crossing page boundaries at once: forces retracts
        max_new = [n + 40 for n in max_new]
    return prompts, max_new


@functools.cache
def _model_and_reference(
    arch: str, root: str, long_decodes: bool = False
) -> tuple[Path, list[list[int]]]:
    model_dir = make_tiny_model_dir(Path(root) / arch, arch=arch, seed=3)
    prompts, max_new = _workload(long_decodes)
    return model_dir, hf_greedy(model_dir, prompts, max_new)


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ref"))


def _sampling(max_new: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]


class TestGreedyMatchesTransformers(EngineTest):
    def _run_twice(self, model_dir: Path, **overrides: object) -> None:
        prompts, max_new = _workload()
        _, expected = _model_and_reference(overrides.pop("arch", "llama"), self._root)  # type: ignore[arg-type]
        with self.engine(model=str(model_dir), **overrides) as engine:
            for _round in range(2):  # the second round runs on a warm prefix cache
                results = engine.generate(prompts, _sampling(max_new))
                got = [r.token_ids for r in results]
                assert got == expected
                self.assert_idle_memory_whole(engine)

    @pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
    def test_architectures(self, arch: str, ref_root: str) -> None:
        self._root = ref_root
        model_dir, _ = _model_and_reference(arch, ref_root)
        self._run_twice(model_dir, arch=arch)

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    @pytest.mark.parametrize("chunk", [0, 16], ids=["nochunk", "chunk16"])
    @pytest.mark.parametrize("cache", ["radix", "none"])
    @pytest.mark.parametrize("page_size", [1, 16])
    def test_matrix(
        self, page_size: int, cache: str, chunk: int, overlap: bool, ref_root: str
    ) -> None:
        self._root = ref_root
        model_dir, _ = _model_and_reference("llama", ref_root)
        self._run_twice(model_dir, page_size=page_size, cache=cache,
                        chunked_prefill_size=chunk, overlap=overlap)

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    @pytest.mark.parametrize("page_size", [1, 16])
    def test_mixed_chunk(self, page_size: int, overlap: bool, ref_root: str) -> None:
        self._root = ref_root
        model_dir, _ = _model_and_reference("llama", ref_root)
        self._run_twice(model_dir, page_size=page_size, chunked_prefill_size=16,
                        enable_mixed_chunk=True, overlap=overlap)

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    @pytest.mark.parametrize(("page_size", "pool"), [(1, 128), (16, 128)])
    def test_small_pool_forces_retracts(
        self, page_size: int, pool: int, overlap: bool, ref_root: str
    ) -> None:
        self._root = ref_root
        model_dir, expected = _model_and_reference("llama", ref_root, long_decodes=True)
        prompts, max_new = _workload(long_decodes=True)
        with self.engine(model=str(model_dir), page_size=page_size, kv_pool_tokens=pool,
                         overlap=overlap) as engine:
            results = engine.generate(prompts, _sampling(max_new))
            assert [r.token_ids for r in results] == expected
            assert engine.stats()["retracted_reqs"] > 0, "the pool was meant to force retracts"
            self.assert_idle_memory_whole(engine)
