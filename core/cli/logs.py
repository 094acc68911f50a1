"""Log records on stderr for the commands that run an engine (`--log-level`).

`--mem-check 2` makes the checker log every step's terms (logger `plugserve.checker`, level
INFO); those lines show even when `--log-level` is higher, since asking for the verbose
checker is asking to see them. Everything is put back when the command ends, so running
the app in-process (tests) leaves the logging configuration as it was.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from plugserve.cli.errors import UsageError

CHECKER_LOGGER = "plugserve.checker"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record arrives: test runners swap it, and
    rich's progress bar redirects it so log lines print above the bar."""

    def __init__(self, level: int) -> None:
        logging.Handler.__init__(self, level)
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


def level_number(name: str) -> int:
    """`logging.INFO` for "info" and so on; another name is a usage error naming the allowed."""
    if name.upper() not in LOG_LEVELS:
        raise UsageError(
            f"--log-level {name!r} is not a log level; allowed: {', '.join(LOG_LEVELS)}"
        )
    return logging.getLevelNamesMapping()[name.upper()]


@contextmanager
def stderr_logging(level: str, mem_check: int = 0) -> Iterator[None]:
    """Send log records of `level` and above to stderr while the block runs; with
    `mem_check >= 2` also the checker's INFO lines (every step's KV terms)."""
    threshold = level_number(level)
    root = logging.getLogger()
    checker = logging.getLogger(CHECKER_LOGGER)
    saved = (root.level, checker.level, checker.propagate)
    installed: list[tuple[logging.Logger, logging.Handler]] = [(root, StderrHandler(threshold))]
    root.setLevel(threshold)
    if mem_check >= 2:
        checker.setLevel(min(threshold, logging.INFO))
        if threshold > logging.INFO:
            # The root handler would drop INFO: the checker gets its own, and does not
            # propagate, so its warnings and errors print once.
            installed.append((checker, StderrHandler(logging.INFO)))
            checker.propagate = False
    for logger, handler in installed:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, handler in installed:
            logger.removeHandler(handler)
        root.setLevel(saved[0])
        checker.setLevel(saved[1])
        checker.propagate = saved[2]
