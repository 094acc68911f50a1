"""The other engines' interpreters (`--vllm-python`, `--llamacpp-python`): each comparison
runs its driver script under a virtual environment of its own, never plugserve's. Before any
engine starts, `check_interpreter` proves that the named file is a Python that imports the
other engine, or raises one line saying what is wrong and how to make one; `run_driver` runs
a driver (`vllm_driver.py`, `llamacpp_driver.py`: JSON in on stdin, JSON out on stdout; exit
3 when the engine does not import) and turns each way it can fail into one such line."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

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


def run_driver(python: Path, driver: Path, work: dict[str, Any], *, name: str, flag: str,
               module: str, result_key: str, setup_hint: str, error: type[Exception],
               timeout_s: float | None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `driver` under `python` with `work` as JSON on stdin and return the JSON object it
    prints last (one that has `result_key`). Its stderr goes to a log file, kept and named in
    the error when the run fails; `name` is the other engine's name in those messages."""
    slug = "".join(c for c in name.lower() if c.isalnum())
    with tempfile.NamedTemporaryFile("w+", prefix=f"plugserve-{slug}-", suffix=".log",
                                     delete=False) as log:
        try:
            done = subprocess.run(
                [str(python), str(driver)], input=json.dumps(work), stdout=subprocess.PIPE,
                stderr=log, text=True, env=env, timeout=timeout_s, check=False,
            )
        except subprocess.TimeoutExpired:
            raise error(f"the {name} driver under {str(python)!r} ran past {timeout_s} s "
                        f"(its log: {log.name})") from None
        except OSError as exc:
            raise error(f"{flag} {str(python)!r} could not be run ({exc}); {setup_hint}") from None
        log.seek(0)
        last = last_line(log.read())
    where = f"the {name} driver under {str(python)!r}"
    if done.returncode == EXIT_MISSING_MODULE:
        raise error(f"{module} does not import under {flag} {str(python)!r} ({last}); "
                    f"{setup_hint}")
    if done.returncode != 0:
        raise error(f"the {name} driver failed under {str(python)!r} (exit {done.returncode}): "
                    f"{last or 'no message'}; its log: {log.name}")
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise error(f"{where} printed no JSON result; its log: {log.name}") from None
    if not isinstance(result, dict) or result_key not in result:
        raise error(f"{where} printed an unexpected result; its log: {log.name}")
    Path(log.name).unlink(missing_ok=True)
    return result
