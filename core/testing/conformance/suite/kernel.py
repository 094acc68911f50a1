"""Kernel-level suite: every scenario of `scenarios.SCENARIOS` on its pairwise shape sample,
against the float64 oracle (see `kernel_checks`)."""

from __future__ import annotations

from typing import Any

import pytest

from plugserve.testing.conformance.kernel_checks import run_kernel_case
from plugserve.testing.conformance.scenarios import KernelCase, kernel_cases
from plugserve.testing.conformance.suite.base import ConformanceTest

__all__ = ["TestKernelDecode", "TestKernelExtend", "TestKernelKVCacheDtype",
           "TestKernelSlidingWindow", "TestKernelSpeculative"]


def cases(scenario: str) -> Any:
    """`parametrize` over the scenario's sample, one test id per shape."""
    return pytest.mark.parametrize(
        "case", [pytest.param(c, id=c.id) for c in kernel_cases(scenario)])


class TestKernelExtend(ConformanceTest):
    @cases("prefill")
    def test_prefill(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("extend_prefix")
    def test_extend_after_cached_prefix(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("mixed")
    def test_mixed_prefill_and_decodes(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)


class TestKernelDecode(ConformanceTest):
    @cases("decode")
    def test_decode(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)


class TestKernelSpeculative(ConformanceTest):
    @cases("draft_extend")
    def test_draft_extend(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("tree_verify")
    def test_tree_mask_verify(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("chain_draft_decode")
    def test_chain_draft_decode(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("topk_draft_decode")
    def test_topk_draft_decode_kv_lists(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)


class TestKernelSlidingWindow(ConformanceTest):
    @cases("window_extend")
    def test_window_extend(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("window_decode")
    def test_window_decode(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("tree_window")
    def test_window_tree_verify(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)


class TestKernelKVCacheDtype(ConformanceTest):
    """A bf16 / fp8 KV cache under wider queries (`kv_cache_dtype`)."""

    @cases("kv_dtype_extend")
    def test_extend_over_a_narrower_cache(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)

    @cases("kv_dtype_decode")
    def test_decode_over_a_narrower_cache(self, case: KernelCase) -> None:
        run_kernel_case(self.target, case)
