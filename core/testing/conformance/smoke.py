"""A few representative suite cases, for backends whose full run is slow (e.g. Triton in its
CPU interpreter): `from plugserve.testing.conformance.smoke import *`.

Hand-picked from the same scenarios as the full suite: an extend after a cached prefix, a
decode batch of uneven lengths, a tree-mask verify, a topk>1 draft decode on the holey page
layout, a sliding window; and one engine run (chunked prefill, prefix-cache hits, page 16).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.testing.conformance.cases import Shape
from plugserve.testing.conformance.engine_checks import assert_second_round_cached, paged
from plugserve.testing.conformance.kernel_checks import run_kernel_case
from plugserve.testing.conformance.scenarios import KernelCase, kernel_case
from plugserve.testing.conformance.suite.base import ConformanceTest
from plugserve.testing.conformance.suite.engine import GreedyEngineTest

__all__ = ["TestEngineSmoke", "TestKernelSmoke"]

SMOKE_CASES = [
    kernel_case("extend_prefix", Shape(16, 3, 64, "float32")),
    kernel_case("decode", Shape(2, 4, 64, "bfloat16")),
    kernel_case("tree_verify", Shape(1, 1, 64, "float16")),
    kernel_case("topk_draft_decode", Shape(16, 3, 64, "float32"), index=1),
    kernel_case("window_extend", Shape(4, 3, 64, "float32"), index=1),
]


class TestKernelSmoke(ConformanceTest):
    @pytest.mark.parametrize(
        "case", [pytest.param(c, id=f"{c.scenario.name}-{c.id}") for c in SMOKE_CASES])
    def test_kernel_case(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)


class TestEngineSmoke(GreedyEngineTest):
    def test_chunked_prefill_with_prefix_cache(self, tiny_model_dir: Path) -> None:
        stats = self.generate(tiny_model_dir, "short", paged(16), rounds=2,
                              chunked_prefill_size=16)
        assert_second_round_cached(stats, "short", 16)
