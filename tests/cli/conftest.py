"""Fixtures of the CLI tests: a clean plugin cache, the dummy plugins, and a CLI runner.

The dummy plugin packages must be installed first: `bash tests/dummy_plugins/install.sh`.
The generate and bench tests also need plugserve-checker installed
(`pip install --no-deps -e plugins/checker`), since they run with `--mem-check 1`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dummy_plugins"))
from plugin_fixtures import dummy_plugins, fresh_plugin_hosts  # noqa: F401 (fixtures)


@dataclass
class Run:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


@pytest.fixture
def cli() -> Iterator[Callable[..., Run]]:
    """`cli(*args, env=None, input=None) -> Run`: the typer app, in this process."""
    from plugserve.cli import app

    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> Run:
        result = runner.invoke(app, list(args), env=env, input=input)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return Run(result.exit_code, result.stdout, result.stderr)

    yield invoke
