"""Fixtures of the tensor-parallel tests: every rank a test starts is gone when it ends.

`no_rank_left_behind` (autouse) compares this process's descendants before and after each
test: a rank (or anything else) still alive is killed and fails the test. `session_process`
starts a command line in a process group of its own and ends the group, also when the test
fails, failing it if anything of the group was still alive. `bounded_time` (autouse) ends the
test run with every thread's traceback when one test runs past `TEST_LIMIT_S` (a collective
that never returns cannot be interrupted from Python; the ranks this process started end when
it does).
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from plugserve.testing.tiny_models import make_tiny_model_dir

from .procs import descendants, kill_all, kill_group, wait_gone

TEST_LIMIT_S = 420.0


@pytest.fixture(autouse=True)
def bounded_time() -> Iterator[None]:
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def no_rank_left_behind() -> Iterator[None]:
    before = descendants()
    yield
    left = wait_gone(descendants() - before, timeout_s=15.0)
    kill_all(left)
    assert not left, f"processes left behind by the test (now killed): {sorted(left)}"


@pytest.fixture
def session_process() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        env = {**os.environ, **kwargs.pop("env", {})}
        proc = subprocess.Popen(args, start_new_session=True, env=env, **kwargs)
        started.append(proc)
        return proc

    yield start
    left: set[int] = set()
    for proc in started:
        left |= kill_group(proc)
    assert not left, f"processes of the test's sessions were still alive (now killed): " \
        f"{sorted(left)}"


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tp_models(arch)`: a tiny random model of `arch`, made once a session."""
    root = tmp_path_factory.mktemp("tp_models")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model_dir(root / arch, arch=arch, seed=7)
        return made[arch]

    return get


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from .closeness import TALLY

    if TALLY.prompts:
        used = TALLY.needed_rule
        terminalreporter.write_line(
            f"tensor-parallel greedy: {len(used)} of {TALLY.prompts} prompt comparisons needed "
            "the top-5 closeness rule" + (f" ({', '.join(used)})" if used else ""))
