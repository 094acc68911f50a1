"""`plugserve conformance --cache NAME` / `--spec NAME`: pytest below, exit code non-zero on
any failure, skips with the reason where a capability is not declared, one error line for a
bad name or a bad combination of options. (`--attention` is test_cli_conformance.py's.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plugserve.cli import app

Run = Callable[..., tuple[int, str]]


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """`run(*args) -> (exit code, output)` of `plugserve conformance`, in this process (the
    inner pytest session gets its own temporary root)."""

    def invoke(*args: str) -> tuple[int, str]:
        inner = ["--", f"--basetemp={tmp_path / 'inner'}"]
        result = CliRunner().invoke(app, ["conformance", *args, *inner])
        return result.exit_code, result.output

    return invoke


def test_passing_cache_policy_exits_zero_and_skips_with_reasons(run: Run) -> None:
    code, out = run("--cache", "none", "-k", "Kernel and page4")
    assert code == 0, out
    assert "passed" in out and "declares prefix_sharing=False" in out


def test_failing_cache_policy_exits_non_zero(cache_plugins: None, run: Run) -> None:
    code, out = run("--cache", "cache_forgets_duplicates", "-k", "duplicates_are_reported")
    assert code == 1, out
    assert "failed" in out and "inserting cached tokens again must report them" in out


@pytest.mark.integration  # the suite on the eagle plugin
def test_spec_suite_on_one_backend(run: Run) -> None:
    pytest.importorskip("plugserve_spec_eagle")
    code, out = run("--spec", "eagle", "--backend", "torch_native", "-k", "Footprint")
    assert code == 0, out
    assert "8 passed" in out


@pytest.mark.integration  # broken copies of the eagle plugin
def test_failing_spec_algorithm_exits_non_zero(spec_plugins: None, run: Run) -> None:
    pytest.importorskip("plugserve_spec_eagle")
    code, out = run("--spec", "eagle_short_footprint", "--backend", "torch_native", "-k",
                    "Lossless and page1-topk1-normal")
    assert code == 1, out
    assert "the rounds broke their footprint" in out


@pytest.mark.parametrize(("args", "message"), [
    (("--cache", "nope"), "unknown cache policy 'nope'; available:"),
    (("--spec", "none"), "speculative algorithm 'none' is plain decoding"),
    pytest.param(("--spec", "eagle", "--backend", "nope"), "unknown attention backend 'nope'",
                 marks=pytest.mark.integration),
    ((), "name exactly one plugin: --attention NAME, --cache NAME, --spec NAME or --grammar "
         "NAME (got none)"),
    (("--grammar", "nope"), "unknown grammar backend 'nope'; available:"),
    (("--grammar", "x", "--spec", "eagle"), "(got --spec eagle, --grammar x)"),
    (("--cache", "radix", "--spec", "eagle"), "(got --cache radix, --spec eagle)"),
    (("--cache", "radix", "--smoke"), "--smoke applies to --attention only"),
    (("--cache", "radix", "--backend", "triton"), "--backend applies to --spec only"),
    (("--cache", "radix", "--device", "cuda"), "the cache-policy and grammar-backend suites run "
                                               "on the CPU"),
    (("--grammar", "x", "--device", "cuda"), "the cache-policy and grammar-backend suites"),
])
def test_bad_options_are_one_error_line(run: Run, args: tuple[str, ...], message: str) -> None:
    code, out = run(*args)
    assert code == 1
    assert out.count("error:") == 1 and message in out, out
