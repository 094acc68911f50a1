"""Benchmark progress off a terminal: heartbeat lines instead of rich's (invisible) bar."""

from __future__ import annotations

import io
import time

from rich.console import Console

from plugserve.bench.line_progress import LineProgress
from plugserve.bench.runner import Runner
from plugserve.config import EngineConfig


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_heartbeat_names_each_running_task_and_counted_tasks_end_with_a_line() -> None:
    console, out = _console()
    with LineProgress(console, every_s=0.05) as progress:
        loading = progress.add_task("W: loading model")
        time.sleep(0.3)
        progress.remove_task(loading)
        timed = progress.add_task("W", total=4)
        progress.advance(timed)
        progress.advance(timed, 2)
        time.sleep(0.3)
        progress.remove_task(timed)
    lines = out.getvalue().splitlines()
    assert any(line.startswith("W: loading model: ") for line in lines), lines
    assert any(line.startswith("W: ") and line.endswith(", 3/4") for line in lines), lines
    assert lines[-1].startswith("W: done, 3/4 in "), lines
    # An uncounted task prints no end line, nor does a counted one shorter than a heartbeat;
    # after the context nothing more is printed.
    with LineProgress(console, every_s=5.0) as progress:
        quick = progress.add_task("quick", total=1)
        progress.advance(quick)
        progress.remove_task(quick)
    assert "quick" not in out.getvalue()
    assert not any("loading model: done" in line for line in lines)
    printed = out.getvalue()
    time.sleep(0.15)
    assert out.getvalue() == printed


def test_runner_uses_lines_off_a_terminal() -> None:
    console, _out = _console()
    runner = Runner(EngineConfig(), console=console)
    with runner.session():
        assert isinstance(runner._progress, LineProgress)
    assert runner._progress is None
