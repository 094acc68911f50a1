"""The grammar-backend suite on a toy third-party plugin (tests/conformance/toy_grammars.py):
it passes the correct toy, and FAILS the toy with a planted bug (EOS allowed before the choice
is complete) where the bug is — the exact-mask kernel test and the engine test — while the
tests the bug does not touch still pass. Also through `plugserve conformance --grammar`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from plugserve.cli import app
from plugserve.testing.conformance.pytest_run import run_module

SUITE = "plugserve.testing.conformance.grammar.suite"


def run(name: str, keyword: str | None = None) -> int:
    return run_module(SUITE, ["--grammar-backend", name], keyword=keyword)


def test_the_suite_passes_the_correct_toy(grammar_plugins: None) -> None:
    assert run("toy_choice") == 0


@pytest.mark.parametrize("keyword", ["test_masks_are_exact_along_every_word",
                                     "TestGrammarEngine and normal",
                                     "TestGrammarEngine and overlap"])
def test_the_suite_fails_the_planted_bug(grammar_plugins: None, keyword: str) -> None:
    assert run("toy_choice_early_eos", keyword) == 1  # pytest's "tests failed"


def test_tests_the_bug_does_not_touch_still_pass(grammar_plugins: None) -> None:
    assert run("toy_choice_early_eos", "test_compiles or test_batched") == 0


def test_cli_runs_the_grammar_suite(grammar_plugins: None) -> None:
    result = CliRunner().invoke(app, ["conformance", "--grammar", "toy_choice_early_eos",
                                      "-k", "test_masks_are_exact"])
    assert result.exit_code == 1, result.output
    unknown = CliRunner().invoke(app, ["conformance", "--grammar", "nope"])
    assert unknown.exit_code != 0 and "toy_choice" in unknown.output
