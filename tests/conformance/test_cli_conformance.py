"""`plugserve conformance`: pytest below, exit code non-zero on any failure, skips with the
reason where the device or a capability is missing, one error line for an unknown name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from plugserve.cli import app

Run = Callable[..., tuple[int, str]]


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """`run(*args) -> (exit code, output)` of `plugserve conformance`, in this process (the
    inner pytest session gets its own temporary root)."""

    def invoke(*args: str) -> tuple[int, str]:
        inner = ["--", f"--basetemp={tmp_path / 'inner'}"] if "--attention" in args else []
        result = CliRunner().invoke(app, ["conformance", *args, *inner])
        return result.exit_code, result.output

    return invoke


def test_passing_backend_exits_zero(example_plugins: None, run: Run) -> None:
    code, out = run("--attention", "torch_native", "-k", "test_prefill and page1")
    assert code == 0, out
    assert "passed" in out


def test_failing_backend_exits_non_zero(example_plugins: None, run: Run) -> None:
    code, out = run("--attention", "example_kv_len_off_by_one", "-k", "test_decode and gqa3")
    assert code == 1, out
    assert "failed" in out and "vs the float64 reference" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA skip")
def test_missing_device_skips_with_the_reason(example_plugins: None, run: Run) -> None:
    code, out = run("--attention", "example", "--device", "cuda", "-k", "test_decode")
    assert code == 0, out
    assert "skipped" in out and "CUDA is not available" in out


def test_undeclared_capability_skips_with_the_reason(example_plugins: None, run: Run) -> None:
    code, out = run("--attention", "example", "-k", "test_topk_draft_decode_kv_lists")
    assert code == 0, out
    assert "PAGE_TREE_WHITELIST" in out


def test_unknown_backend_is_one_error_line(run: Run) -> None:
    code, out = run("--attention", "nope")
    assert code == 1
    assert "unknown attention backend 'nope'; available:" in out
    assert "torch_native" in out
