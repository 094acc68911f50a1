"""Run one conformance suite module under pytest, in this process, isolated from any project.

`run_module(module, options)` writes a one-line test module (`from <module> import *`, named
after the module) into a fresh temporary folder with an empty `pytest.ini`, so no project's configuration or conftest
leaks in, and runs pytest on it with `options` (e.g. `["--cache-policy", "mine"]`). The return
value is pytest's exit code: 0 when every test passed or was skipped, non-zero on any failure.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


def module_args(folder: Path, module: str, options: Sequence[str], *,
                keyword: str | None = None, pytest_args: Sequence[str] = ()) -> list[str]:
    """Write the test module into `folder` and return the pytest arguments that run it."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    # One file name per suite module: pytest may reuse an imported test module of the same
    # name when several suites run in one process.
    name = "test_" + module.replace(".", "_") + ".py"
    (folder / name).write_text(
        f'"""plugserve conformance suite."""\n\nfrom {module} import *  # noqa: F403\n')
    args = [str(folder), *options, "-p", "no:cacheprovider", "--import-mode=importlib",
            "-rfEsx"]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):  # the options come from the plugin
        args += ["-p", "plugserve.testing.pytest_plugin"]
    if keyword:
        args += ["-k", keyword]
    return [*args, *pytest_args]


def run_module(module: str, options: Sequence[str], *, keyword: str | None = None,
               pytest_args: Sequence[str] = ()) -> int:
    """Run the suite in `module` with `options`; pytest's exit code."""
    import pytest

    with tempfile.TemporaryDirectory(prefix="plugserve-conformance-") as tmp:
        args = module_args(Path(tmp), module, options, keyword=keyword,
                           pytest_args=pytest_args)
        return int(pytest.main(args))
