"""The suite FAILS each broken double of the example backend (tests/conformance/
broken_backends.py), at kernel and engine level, and only where its bug shows: this is what
proves the suite can fail. (test_cli_conformance.py shows the same through pytest and the
command line.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.testing import EngineTest
from plugserve.testing.conformance import engine_checks as checks
from plugserve.testing.conformance.engine_checks import paged
from plugserve.testing.conformance.kernel_checks import run_kernel_case
from plugserve.testing.conformance.scenarios import kernel_cases
from plugserve.testing.conformance.target import BackendUnderTest

# backend -> (kernel scenarios that must fail, scenarios its bug does not touch)
EXPECTED = {
    "example_no_prefix_offset": (
        ["extend_prefix", "mixed", "draft_extend", "window_extend"],
        ["prefill", "decode", "tree_verify"],
    ),
    "example_contiguous_slots": (
        ["prefill", "extend_prefix", "mixed", "decode", "tree_verify", "window_decode"],
        [],
    ),
    "example_kv_len_off_by_one": (
        ["decode", "chain_draft_decode", "window_decode"],
        ["prefill", "extend_prefix", "mixed"],
    ),
}
BROKEN = pytest.mark.parametrize("name", sorted(EXPECTED))
# A capability declared but not honoured: only the cases needing it fail (kernel level).
UNHONOURED = {
    "example_ignores_window": (
        ["window_extend", "window_decode", "tree_window"],
        ["prefill", "extend_prefix", "decode", "tree_verify"],
    ),
    "example_unrounded_new_kv": (
        ["kv_dtype_extend", "kv_dtype_decode"],
        ["prefill", "extend_prefix", "decode", "window_decode"],
    ),
}


def _failures(target: BackendUnderTest, scenario: str) -> list[str]:
    failed = []
    for case in kernel_cases(scenario):
        try:
            run_kernel_case(target, case)
        except Exception as exc:  # an index error counts as much as a wrong number
            failed.append(f"{case.id}: {type(exc).__name__}")
    return failed


@BROKEN
def test_kernel_suite_fails_where_the_bug_is(name: str, example_plugins: None) -> None:
    target = BackendUnderTest.resolve(name)
    must_fail, must_pass = EXPECTED[name]
    for scenario in must_fail:
        assert _failures(target, scenario), f"{name}: every {scenario} case passed"
    for scenario in must_pass:
        assert _failures(target, scenario) == [], f"{name}: {scenario} should be unaffected"


@pytest.mark.parametrize("name", sorted(UNHONOURED))
def test_a_declared_capability_must_be_honoured(name: str, example_plugins: None) -> None:
    target = BackendUnderTest.resolve(name)
    assert target.capabilities.sliding_window  # declared, so its cases run and must pass
    must_fail, must_pass = UNHONOURED[name]
    for scenario in must_fail:
        assert _failures(target, scenario), f"{name}: every {scenario} case passed"
    for scenario in must_pass:
        assert _failures(target, scenario) == [], f"{name}: {scenario} should be unaffected"


class TestEngineLevelFails(EngineTest):
    @BROKEN
    def test_fp32_greedy_differs_from_transformers(
        self, name: str, example_plugins: None, tiny_model_dir: Path
    ) -> None:
        target = BackendUnderTest.resolve(name)
        expected = checks.hf_reference(str(tiny_model_dir), "mixed")
        with self.engine(model=str(tiny_model_dir), attention=name, device="cpu",
                         **paged(16).overrides, chunked_prefill_size=16) as engine:
            with pytest.raises(AssertionError, match="differs from transformers fp32"):
                checks.run_generations(engine, target, "mixed", rounds=2, expected=expected)

    def test_half_precision_margin_catches_the_subtlest(
        self, example_plugins: None, tiny_model_dir: Path
    ) -> None:
        """Missing only the decoded token's own key moves logits least; bf16 still fails."""
        name = "example_kv_len_off_by_one"
        target = BackendUnderTest.resolve(name)
        with self.engine(model=str(tiny_model_dir), attention=name, dtype="bfloat16",
                         page_size=16, chunked_prefill_size=16) as engine:
            outputs = checks.run_generations(engine, target, "mixed", expected=None)
        with pytest.raises(AssertionError, match="below transformers fp32's best choice"):
            checks.assert_near_greedy(str(tiny_model_dir), "mixed", outputs[0], "bfloat16")
