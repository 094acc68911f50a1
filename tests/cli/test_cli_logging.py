"""`--log-level` and `--mem-check 2`: log records on stderr for the commands that run an
engine. `--mem-check 2` shows the checker's per-step terms whatever `--log-level` says.

Runs with the checker, so plugserve-checker must be installed
(`pip install --no-deps -e plugins/checker`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.cli.logs import CHECKER_LOGGER, stderr_logging

ENV = {"PLUGSERVE_PLUGINS": "checker"}
STEP_LINE = re.compile(r"^INFO plugserve\.checker: step \d+ busy: full: avail=\d+ .*total=\d+")


def generate(cli: Callable[..., Any], model: Path, *args: str) -> Any:
    return cli("generate", "hello world", "--model", str(model), "--max-new-tokens", "4",
               "--json", *args, env=ENV)


def step_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if STEP_LINE.match(line)]


@pytest.mark.parametrize("level", [None, "ERROR", "warning", "INFO"])
def test_mem_check_2_shows_every_step(cli: Callable[..., Any], tiny_model_dir: Path,
                                      level: str | None) -> None:
    run = generate(cli, tiny_model_dir, "--mem-check", "2",
                   *(("--log-level", level) if level else ()))
    assert run.exit_code == 0, run.stderr
    lines = step_lines(run.stderr)
    # Prefill, then one decode step per further token (4 tokens: at least 4 busy steps),
    # each printed once (never twice through two handlers).
    assert len(lines) >= 4, run.stderr
    steps = [int(line.split()[3]) for line in lines]
    assert steps == sorted(set(steps)), run.stderr
    assert re.search(r"^INFO plugserve\.checker: step \d+ idle: full: ", run.stderr, re.M)


def test_mem_check_1_is_quiet(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    run = generate(cli, tiny_model_dir, "--mem-check", "1", "--log-level", "INFO")
    assert run.exit_code == 0, run.stderr
    assert "plugserve.checker" not in run.stderr


def test_mem_check_from_the_environment(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    run = cli("generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2",
              "--json", env={**ENV, "PLUGSERVE_MEM_CHECK": "2"})
    assert run.exit_code == 0, run.stderr
    assert step_lines(run.stderr)


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_unknown_log_level_names_the_allowed(cli: Callable[..., Any], command: str) -> None:
    run = cli(command, *(["hi"] if command == "generate" else []), "--log-level", "LOUD",
              env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1
    assert run.stderr_lines == [
        "error: --log-level 'LOUD' is not a log level; allowed: DEBUG, INFO, WARNING, ERROR"
    ]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_lists_log_level(cli: Callable[..., Any], command: str) -> None:
    run = cli(command, "--help")
    assert run.exit_code == 0
    assert "--log-level" in run.stdout


def test_stderr_logging_filters_and_restores(capsys: pytest.CaptureFixture[str]) -> None:
    root, checker = logging.getLogger(), logging.getLogger(CHECKER_LOGGER)
    before = (root.level, list(root.handlers), checker.level, list(checker.handlers),
              checker.propagate)
    other = logging.getLogger("plugserve.cli_test")
    with stderr_logging("info"):
        other.debug("hidden")
        other.info("shown")
    with stderr_logging("ERROR", mem_check=2):
        other.warning("hidden too")
        checker.info("step 1 busy: terms")
        checker.error("once")
    other.error("after: not ours")
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert "INFO plugserve.cli_test: shown" in err
    assert "INFO plugserve.checker: step 1 busy: terms" in err
    assert err.count("ERROR plugserve.checker: once") == 1
    assert "ERROR plugserve.cli_test: after" not in err
    after = (root.level, list(root.handlers), checker.level, list(checker.handlers),
             checker.propagate)
    assert after == before
