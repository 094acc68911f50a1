"""How the command line reports errors: one line on stderr, exit code 1, `--debug` adds the
traceback. Errors a user can act on print as they are; anything else names its type and
says where to find more."""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer

_BULLET = re.compile(r"^[-*•]\s+")


class UsageError(ValueError):
    """A bad command-line value that only the command itself can judge."""


def one_line(text: str) -> str:
    """Join a multi-line message (e.g. a bulleted list of reasons) into one line."""
    parts = [_BULLET.sub("", line.strip()) for line in str(text).splitlines()]
    parts = [part for part in parts if part]
    if not parts:
        return ""
    head, rest = parts[0], parts[1:]
    if not rest:
        return head
    sep = " " if head.endswith(":") else "; "
    return head + sep + "; ".join(rest)


def describe_error(exc: BaseException) -> str:
    """One line a user can act on; unexpected errors say where to find more."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "invalid configuration: " + "; ".join(_pydantic_issue(e) for e in exc.errors())
    if is_user_error(exc):
        return one_line(str(exc))
    return f"{type(exc).__name__}: {one_line(str(exc))} (run with --debug for the traceback)"


def _pydantic_issue(error: Any) -> str:
    msg = str(error.get("msg", "")).removeprefix("Value error, ")
    loc = ".".join(str(part) for part in error.get("loc", ()))
    return f"{loc}={error.get('input')!r}: {msg}" if loc else msg


def is_user_error(exc: BaseException) -> bool:
    """Errors whose message already says what was wrong and what is allowed."""
    from plugserve.bench.runner import BenchOptionsError, RequestRejectedError
    from plugserve.model.errors import ModelLoadError
    from plugserve.plugins import PluginError
    from plugserve.registry import RegistryError

    known: tuple[type[BaseException], ...] = (
        PluginError,
        RegistryError,
        ModelLoadError,
        RequestRejectedError,
        BenchOptionsError,
        UsageError,
    )
    if isinstance(exc, known):
        return True
    # By name: importing the engine module would import torch just to classify an error.
    return type(exc).__name__ == "EngineStartError"


@contextmanager
def reported_errors(debug: bool) -> Iterator[None]:
    """Turn any error into one stderr line and exit code 1 (the traceback too with --debug)."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug:
            traceback.print_exc(file=sys.stderr)
        typer.echo(f"error: {describe_error(exc)}", err=True)
        raise typer.Exit(1) from None
