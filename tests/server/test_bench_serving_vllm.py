"""`plugserve bench serving --compare vllm` plumbing, with a TEST DOUBLE in vLLM's place
(tests/server/fake_vllm.py: its "server" is plugserve itself, its "client" a few streaming
requests that fail unless every token arrives). Checked: each server is started, measured and
stopped in turn (both plugserve modes and the stand-in), the offline run, the ratios and the
time split, and no process left behind."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from serve_process import alive, children_of
from typer.testing import CliRunner

from plugserve.cli import app

FAKE = Path(__file__).with_name("fake_vllm.py")


def new_children(before: set[int]) -> list[int]:
    """This process's children still alive that were not there before the run (a process
    an earlier test left for the whole session, e.g. multiprocessing's resource tracker
    after a spawn, is not this run's)."""
    return [p for p in children_of(os.getpid()) if p not in before and alive(p)]


def fake_vllm_python(folder: Path) -> Path:
    wrapper = folder / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


@pytest.mark.parametrize(("dataset", "interval"), [("random", 1), ("chat", 3)])
def test_compare_vllm_plumbing(tiny_model_dir: Path, tmp_path: Path, dataset: str,
                               interval: int) -> None:
    before = set(children_of(os.getpid()))
    run: Any = CliRunner().invoke(app, [
        "bench", "serving", "--compare", "vllm", "--vllm-python",
        str(fake_vllm_python(tmp_path)), "--model", str(tiny_model_dir), "--num-seqs", "4",
        "--input-len", "16", "--output-len", "8", "--dataset", dataset,
        "--stream-interval", str(interval), "--json"])
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["backend"] == ("openai-chat" if dataset == "chat" else "openai")
    assert report["stream_interval"] == interval
    for which in ("plugserve", "plugserve_thread", "vllm"):
        assert report[which]["completed"] == 4 and report[which]["failed"] == 0
        assert report[which]["total_output_tokens"] == 4 * 8
    assert report["offline"]["total_output_tokens"] == 4 * 8
    assert report["offline"]["engine_steps"] >= 8
    for which in ("plugserve", "plugserve_thread"):
        mine = report[which]
        assert mine["vs_vllm"] == pytest.approx(
            mine["output_throughput"] / report["vllm"]["output_throughput"])
        assert mine["vs_offline"] == pytest.approx(
            mine["output_throughput"] / report["offline"]["output_throughput"])
        assert math.isfinite(mine["vs_vllm"]) and mine["vs_vllm"] > 0
        assert mine["time_split_s"]["engine_step"] > 0
        assert mine["time_split_s"]["http_loop_cpu"] > 0
        assert mine["engine_steps"] >= 8  # at least one step per output token
        # The engine's step phases from the server's /metrics; the client's CPU.
        assert mine["step_phases_s"]["run"] >= mine["step_phases_s"]["forward"] > 0
        assert mine["client_cpu_s"] > 0
    assert report["offline"]["step_phases_s"]["forward"] > 0
    assert "engine_process_cpu" in report["plugserve"]["time_split_s"]
    assert "engine_process_cpu" not in report["plugserve_thread"]["time_split_s"]
    assert report["plugserve_vs_vllm"] == report["plugserve"]["vs_vllm"]
    left = new_children(before)
    assert not left, f"processes left: {left}"


def test_compare_vllm_client_failure_stops_the_server(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    """A client that fails: the run says where its log is, and the server is stopped."""
    broken = tmp_path / "python"
    broken.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit 3; fi\n'
                      f'exec "{sys.executable}" "{FAKE}" "$@"\n')
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    before = set(children_of(os.getpid()))
    run: Any = CliRunner().invoke(app, [
        "bench", "serving", "--compare", "vllm", "--vllm-python", str(broken), "--model",
        str(tiny_model_dir), "--num-seqs", "2", "--input-len", "8", "--output-len", "4"])
    assert run.exit_code != 0
    assert "vllm bench serve against plugserve failed (exit 3)" in run.stderr
    left = new_children(before)
    assert not left, f"processes left: {left}"


def test_step_phases_line() -> None:
    from plugserve.bench.serving_vllm import step_phases_line

    served = {"step_phases_s": {"run": 1.5, "forward": 1.2}, "engine_steps": 10,
              "client_cpu_s": 2.0}
    offline = {"step_phases_s": {"run": 1.0, "forward": 1.0}, "engine_steps": 10}
    assert step_phases_line(served, offline) == (
        "run 150.0 ms per step served, 100.0 offline (1.50x); forward 120.0 ms per step "
        "served, 100.0 offline (1.20x); the client's CPU (start-up included) 2.0 s")
    assert step_phases_line({**served, "step_phases_s": {}}, offline) == ""


@pytest.mark.parametrize("compare", [True, False])
def test_a_bad_stream_interval_is_refused_before_anything_starts(tiny_model_dir: Path,
                                                                 compare: bool) -> None:
    target = (["--compare", "vllm", "--vllm-python", "/bin/false", "--model",
               str(tiny_model_dir)] if compare else ["--base-url", "http://127.0.0.1:9"])
    run: Any = CliRunner().invoke(app, ["bench", "serving", *target, "--stream-interval", "0"])
    assert run.exit_code != 0
    expected = ("--stream-interval must be at least 1" if compare
                else "stream_interval must be >= 1, got 0")
    assert expected in run.stderr, run.stderr
