"""Run the conformance suite on one backend from Python or the command line (pytest below).

`run_suite("mine")` writes a one-line test module (`from <suite> import *`) into a fresh
temporary folder with an empty `pytest.ini`, so no project's configuration or conftest leaks
in, and runs pytest on it in this process with `--attention-backend mine`. The return value
is pytest's exit code: 0 when every test passed or was skipped, non-zero on any failure.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

FULL = "plugserve.testing.conformance.suite"
SMOKE = "plugserve.testing.conformance.smoke"


def suite_args(
    folder: Path, attention: str, *, device: str | None = None, keyword: str | None = None,
    smoke: bool = False, pytest_args: Sequence[str] = (),
) -> list[str]:
    """Write the test module into `folder` and return the pytest arguments that run it."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    module = SMOKE if smoke else FULL
    (folder / "test_plugserve_conformance.py").write_text(
        f'"""plugserve conformance suite."""\n\nfrom {module} import *  # noqa: F403\n')
    args = [str(folder), "--attention-backend", attention, "-p", "no:cacheprovider",
            "--import-mode=importlib", "-rfEsx"]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):  # our fixtures come from the plugin
        args += ["-p", "plugserve.testing.pytest_plugin"]
    if device:
        args += ["--conformance-device", device]
    if keyword:
        args += ["-k", keyword]
    return [*args, *pytest_args]


def run_suite(
    attention: str, *, device: str | None = None, keyword: str | None = None,
    smoke: bool = False, pytest_args: Sequence[str] = (),
) -> int:
    """Run the suite (or its smoke subset) on backend `attention`; pytest's exit code."""
    import pytest

    with tempfile.TemporaryDirectory(prefix="plugserve-conformance-") as tmp:
        args = suite_args(Path(tmp), attention, device=device, keyword=keyword, smoke=smoke,
                          pytest_args=pytest_args)
        return int(pytest.main(args))
