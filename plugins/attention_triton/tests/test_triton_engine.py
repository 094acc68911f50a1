"""Engine level: greedy output with the Triton backend is identical to torch_native's.

A tiny random model runs through the whole engine (scheduler, prefix cache, chunked
prefill, paged memory) with the invariant checker on; only the attention backend differs.
The engine runs where this process's kernels run (cpu under the interpreter, else cuda).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.tiny_models import make_tiny_model_dir


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[(13 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 23, 40])]
    prompts.append([*prompts[2][:30], 9, 8, 7])  # shares a cached prefix with prompt 2
    max_new = [9, 14, 6, 11]
    return prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]


class TestTritonEngine(EngineTest):
    @pytest.fixture(autouse=True)
    def _device(self, kernel_device: torch.device) -> None:
        self.device = str(kernel_device)

    def _generate(self, model_dir: Path, attention: str, **overrides: object) -> list[list[int]]:
        prompts, sampling = _workload()
        with self.engine(model=str(model_dir), attention=attention, device=self.device,
                         **overrides) as engine:
            results = engine.generate(prompts, sampling)
            self.assert_idle_memory_whole(engine)
        return [r.token_ids for r in results]

    @pytest.mark.parametrize("page_size", [1, 16])
    def test_greedy_matches_torch_native(self, tiny_model_dir: Path, page_size: int) -> None:
        options = {"page_size": page_size, "chunked_prefill_size": 16}
        want = self._generate(tiny_model_dir, "torch_native", **options)
        got = self._generate(tiny_model_dir, "triton", **options)
        assert got == want

    def test_sliding_window_model(self, tmp_path: Path) -> None:
        model_dir = make_tiny_model_dir(tmp_path / "mistral", arch="mistral", seed=1,
                                        sliding_window=8)
        options = {"page_size": 4, "chunked_prefill_size": 16}
        want = self._generate(model_dir, "torch_native", **options)
        got = self._generate(model_dir, "triton", **options)
        assert got == want
