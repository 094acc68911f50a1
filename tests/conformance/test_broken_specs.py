"""The speculative suite FAILS each broken algorithm of broken_specs.py, and only where its
bug is: this is what proves the suite can fail. Each case runs the suite's own test method on
the broken algorithm."""

from __future__ import annotations

from typing import Any

import pytest

from plugserve.testing import EngineTest
from plugserve.testing.conformance.spec import engine as spec_suite
from plugserve.testing.conformance.spec.cases import SpecCase
from plugserve.testing.conformance.spec.target import SpecAlgorithmUnderTest

pytest.importorskip("plugserve_spec_eagle")
pytestmark = pytest.mark.integration  # broken copies of the eagle plugin

LOSSLESS, FOOTPRINT = spec_suite.TestSpecLossless, spec_suite.TestSpecFootprint


def case(page_size: int, topk: int, overlap: bool) -> SpecCase:
    return SpecCase("torch_native", page_size, topk, overlap)


# algorithm -> (cases that must fail: (suite class, case, what the failure says), cases that
# must pass)
EXPECTED: dict[str, tuple[list[tuple[type, SpecCase, str]], list[tuple[type, SpecCase]]]] = {
    # A chain's footprint is tight: the round writes one past what it declared. Only the
    # probe sees it under the normal loop (the two-round reserve still covers it).
    "eagle_short_footprint": (
        [(LOSSLESS, case(1, 1, False), "outside \\[L, L \\+ alloc_len_per_decode\\)"),
         (LOSSLESS, case(16, 1, False), "outside \\[L, L \\+ alloc_len_per_decode\\)"),
         (LOSSLESS, case(1, 1, True), "broke their footprint")],
        # Tree footprints have slack: one slot less still covers what a round writes.
        [(LOSSLESS, case(16, 2, False)), (FOOTPRINT, case(1, 1, False))],
    ),
    "eagle_wrong_token": (
        [(LOSSLESS, case(1, 1, False), "differs from plain greedy"),
         (LOSSLESS, case(16, 2, True), "differs from plain greedy")],
        [(FOOTPRINT, case(16, 2, True))],
    ),
}


def run_suite_test(cls: type, spec_case: SpecCase, target: SpecAlgorithmUnderTest,
                   factory: pytest.TempPathFactory) -> None:
    """Run the suite's test of `cls` on one case, as the suite would (every case here is one
    the algorithm and the reference backend declare)."""
    suite: Any = cls()
    suite.target, suite.case, suite.device = target, spec_case, "cpu"
    if cls is LOSSLESS:
        suite.test_lossless_and_the_law(spec_case, factory)
    else:
        suite.test_footprint_covers_a_round_and_fits_the_rows(spec_case)


class TestBrokenAlgorithmsFail(EngineTest):
    @pytest.mark.parametrize("name", sorted(EXPECTED))
    def test_the_suite_fails_where_the_bug_is(
        self, name: str, spec_plugins: None, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        target = SpecAlgorithmUnderTest.resolve(name)
        must_fail, must_pass = EXPECTED[name]
        for cls, spec_case, message in must_fail:
            with pytest.raises(AssertionError, match=message):
                run_suite_test(cls, spec_case, target, tmp_path_factory)
        for cls, spec_case in must_pass:
            run_suite_test(cls, spec_case, target, tmp_path_factory)
