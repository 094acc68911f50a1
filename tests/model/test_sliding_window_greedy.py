"""Sliding-window models through the engine: greedy output token-identical to transformers.

Every tiny sliding-window arch (Mistral with every layer windowed, Qwen2 hybrid through
max_window_layers, Qwen3 hybrid through layer_types, Gemma 3 with 5 local : 1 global layers)
runs through the engine with the torch_native backend and the invariant checker (level 1,
physical page checks), for page sizes 1 and 16, the normal and overlap loops and chunked
prefill off and at 16 tokens. Windows are 16-24 tokens; prompts and outputs run to several
windows, and one short prompt crosses its window only while decoding.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts
from plugserve.testing.tiny_models import SLIDING_WINDOW_ARCHITECTURES, make_tiny_model_dir

VOCAB = 256


def _workload() -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(3, VOCAB, 50, 90, seed=11)
    prompts.append(random_prompts(1, VOCAB, 6, 6, seed=12)[0])  # shorter than every window
    prompts.append([*prompts[0][:40], 5, 6, 7])  # shares a 40-token prefix with prompt 0
    max_new = [40, 12, 30, 70, 24]
    return prompts, max_new


@functools.cache
def _model_and_reference(arch: str, root: str) -> tuple[Path, list[list[int]]]:
    model_dir = make_tiny_model_dir(Path(root) / arch, arch=arch, seed=5)
    prompts, max_new = _workload()
    return model_dir, hf_greedy(model_dir, prompts, max_new)


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("swa_ref"))


class TestSlidingWindowGreedyMatchesTransformers(EngineTest):
    env = {"PLUGSERVE_ATTENTION": "torch_native"}

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    @pytest.mark.parametrize("chunk", [0, 16], ids=["nochunk", "chunk16"])
    @pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
    @pytest.mark.parametrize("arch", SLIDING_WINDOW_ARCHITECTURES)
    def test_greedy(
        self, arch: str, page_size: int, chunk: int, overlap: bool, ref_root: str
    ) -> None:
        model_dir, expected = _model_and_reference(arch, ref_root)
        prompts, max_new = _workload()
        sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]
        with self.engine(model=str(model_dir), page_size=page_size,
                         chunked_prefill_size=chunk, overlap=overlap) as engine:
            assert engine.arch.sliding_window_layer_ids, "the model was meant to have windows"
            window = engine.arch.sliding_window
            assert window is not None and all(len(p) > 2 * window for p in prompts[:3])
            for _round in range(2):  # the second round starts from a warm prefix cache
                results = engine.generate(prompts, sampling)
                assert [r.error for r in results] == [None] * len(prompts)
                assert [r.token_ids for r in results] == expected
                self.assert_idle_memory_whole(engine)
