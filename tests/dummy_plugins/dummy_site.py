"""Puts the dummy plugin packages on the path of one test (in-process) or one subprocess.

They are installed by `bash tests/dummy_plugins/install.sh` into `tests/dummy_plugins/.site`
rather than into the venv: several are broken or clash with the built-ins on purpose.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parent / ".site"
INSTALL = "bash tests/dummy_plugins/install.sh"
# entry point name -> distribution
DISTRIBUTIONS = {
    "good": "plugserve-dummy-good",
    "broken_import": "plugserve-dummy-broken-import",
    "misspelt_hook": "plugserve-dummy-misspelt-hook",
    "duplicate_name": "plugserve-dummy-duplicate-name",
    "bad_signature": "plugserve-dummy-bad-signature",
}


def require_installed() -> None:
    """Fail (not skip: CI installs them) with the command that installs the dummy plugins."""
    missing = [
        dist
        for dist in DISTRIBUTIONS.values()
        if not any(SITE.glob(f"{dist.replace('-', '_')}-*.dist-info"))
    ]
    if missing:
        pytest.fail(
            f"dummy plugin packages are not installed ({', '.join(missing)}); run: {INSTALL}",
            pytrace=False,
        )


@contextmanager
def activated() -> Iterator[Path]:
    """The dummy plugins are installed for the duration of the block (this process only)."""
    from plugserve.plugins import clear_plugin_hosts

    require_installed()
    sys.path.insert(0, str(SITE))
    importlib.invalidate_caches()
    clear_plugin_hosts()
    try:
        yield SITE
    finally:
        sys.path.remove(str(SITE))
        for name in [m for m in sys.modules if m.startswith("plugserve_dummy_")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        clear_plugin_hosts()


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a `plugserve` subprocess that sees the dummy plugins."""
    require_installed()
    env = {k: v for k, v in os.environ.items() if k != "PLUGSERVE_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env
