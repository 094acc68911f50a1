"""The other engines' interpreters (`--vllm-python`, `--llamacpp-python`): each comparison
runs its driver script under a virtual environment of its own, never plugserve's. Before any
engine starts, `check_interpreter` proves that the named file is a Python that imports the
other engine, or raises one line saying what is wrong and how to make one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

CHECK_TIMEOUT_S = 120.0
EXIT_MISSING_MODULE = 3  # the probe's (and the drivers') exit status: the module does not import


def check_interpreter(python: Path, *, flag: str, module: str, package: str,
                      setup_hint: str, error: type[Exception]) -> None:
    """`python` runs and finds `module` (installed as `package`); `error(message)` if not.
    `flag` is the command-line option that named it."""
    named = f"{flag} {str(python)!r}"
    if not python.exists():
        raise error(f"{named}: no such interpreter; {setup_hint}")
    if python.is_dir() or not os.access(python, os.X_OK):
        raise error(f"{named} is not an executable Python interpreter; {setup_hint}")
    probe = ("import importlib.util, sys; "
             f"sys.exit(0 if importlib.util.find_spec({module!r}) else {EXIT_MISSING_MODULE})")
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise error(f"{named} could not be run ({exc}); {setup_hint}") from None
    if done.returncode == EXIT_MISSING_MODULE:
        raise error(f"{package} is not installed for {named}; {setup_hint}")
    if done.returncode != 0:
        reason = last_line(done.stderr) or f"exit {done.returncode}"
        raise error(f"{named} is not a working Python interpreter ({reason}); {setup_hint}")


def last_line(text: str) -> str:
    """The last non-blank line of a driver's output (its one-line reason on failure)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
