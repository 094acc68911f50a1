"""Engine-level suite, tensor-parallel case: the backend attends over one rank's heads.

Two ranks (gloo on the CPU, nccl on two CUDA devices), the backend built on each with that
rank's head counts (`AttentionContext.num_heads` = heads / 2): fp32 greedy output must still
be token-identical to transformers fp32, with the checker at level 1 on every rank and the
cross-rank check after every step. A backend without `tensor_parallel` in its capabilities
is skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plugserve.testing.conformance import engine_checks as checks
from plugserve.testing.conformance.engine_checks import EngineCase, paged
from plugserve.testing.conformance.requirements import requires
from plugserve.testing.conformance.suite.base import ConformanceTest
from plugserve.testing.engine_test import EngineTest

__all__ = ["TestEngineTensorParallel"]


@requires("dtype:float32", "tensor_parallel")
class TestEngineTensorParallel(ConformanceTest, EngineTest):
    @pytest.mark.parametrize("case", [paged(16)], ids=str)
    def test_two_ranks_greedy(self, case: EngineCase, tiny_model_dir: Path) -> None:
        if self.target.device.startswith("cuda") and torch.cuda.device_count() < 2:
            pytest.skip("two tensor-parallel ranks on CUDA need two CUDA devices")
        expected = checks.hf_reference(str(tiny_model_dir), "mixed")
        with self.engine(model=str(tiny_model_dir), attention=self.target.name,
                         dtype="float32", device=self.target.device, tp_size=2,
                         chunked_prefill_size=16, overlap=True, **case.overrides) as engine:
            assert engine.backend.ctx.num_heads == engine.arch.num_attention_heads // 2
            checks.run_generations(engine, self.target, "mixed", rounds=2, expected=expected)
