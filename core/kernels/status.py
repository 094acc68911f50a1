"""What the CPU-kernel build shows while it runs (`plugserve.kernels.compile`).

On a terminal: one rich progress line on stderr, with a spinner and the elapsed time, saying
what is compiled, for which instruction sets and why (first start, or the sources changed),
and which source is compiling now. Elsewhere (a log, a pipe, CI): a plain line per finished
source, and a line at least every `HEARTBEAT_S` seconds while a long one compiles, so no step
is silent for long. A start that finds the library built shows nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Protocol

HEARTBEAT_S = 5.0


class BuildStatus(Protocol):
    def waiting(self, owner: str, waited_s: float) -> None:
        """Another process holds the build lock (it is compiling the same kernels)."""

    def begin(self, jobs: int, cached: int, isas: list[str], started: float) -> None:
        """`jobs` sources are about to compile (`cached` were found compiled)."""

    def job_started(self, label: str) -> None: ...

    def job_done(self, label: str, seconds: float) -> None: ...

    def job_failed(self, label: str) -> None: ...

    def linking(self) -> None: ...

    def end(self, seconds: float, path: Path) -> None: ...

    def close(self) -> None:
        """The build is over, whatever happened: stop anything still drawing."""


class Silent:
    """Shows nothing (tests, and callers that report on their own)."""

    def waiting(self, owner: str, waited_s: float) -> None: ...
    def begin(self, jobs: int, cached: int, isas: list[str], started: float) -> None: ...
    def job_started(self, label: str) -> None: ...
    def job_done(self, label: str, seconds: float) -> None: ...
    def job_failed(self, label: str) -> None: ...
    def linking(self) -> None: ...
    def end(self, seconds: float, path: Path) -> None: ...
    def close(self) -> None: ...


def _headline(reason: str, isas: list[str], jobs: int, cached: int) -> str:
    reused = f", {cached} reused" if cached else ""
    return (f"Compiling plugserve's CPU kernels for {', '.join(isas)} ({reason}; "
            f"{jobs} sources{reused}; cached for later starts)")


class LineStatus:
    """Plain lines on stderr, with a heartbeat while a source compiles."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.running: dict[str, float] = {}
        self.done = 0
        self.total = 0
        self._lock = threading.Lock()
        self._last_line = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _say(self, text: str) -> None:
        with self._lock:
            print(f"plugserve: {text}", file=sys.stderr, flush=True)
            self._last_line = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self._last_line >= HEARTBEAT_S:
                with self._lock:
                    running = ", ".join(
                        f"{label} ({time.monotonic() - t:.0f} s)" for label, t in self.running.items()
                    )
                self._say(f"still compiling [{self.done}/{self.total}]: {running or 'linking'}")

    def waiting(self, owner: str, waited_s: float) -> None:
        if time.monotonic() - self._last_line >= HEARTBEAT_S or waited_s < 2.5:
            self._say(f"waiting for another process building the CPU kernels ({owner}), "
                      f"{waited_s:.0f} s so far")

    def begin(self, jobs: int, cached: int, isas: list[str], started: float) -> None:
        self.total = jobs
        self._say(_headline(self.reason, isas, jobs, cached))
        self._thread = threading.Thread(target=self._heartbeat, daemon=True)
        self._thread.start()

    def job_started(self, label: str) -> None:
        with self._lock:
            self.running[label] = time.monotonic()

    def job_done(self, label: str, seconds: float) -> None:
        with self._lock:
            self.running.pop(label, None)
            self.done += 1
            done = self.done
        self._say(f"[{done}/{self.total}] compiled {label} in {seconds:.1f} s")

    def job_failed(self, label: str) -> None:
        with self._lock:
            self.running.pop(label, None)
        self._say(f"compiling {label} failed")

    def linking(self) -> None:
        self._say("linking the kernels into one library")

    def end(self, seconds: float, path: Path) -> None:
        self._stop.set()
        self._say(f"CPU kernels ready in {seconds:.0f} s ({path})")

    def close(self) -> None:
        self._stop.set()


class RichStatus:
    """One live rich progress line on stderr (a terminal)."""

    def __init__(self, reason: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.reason = reason
        self.console = Console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=False,
        )
        self.task: object | None = None
        self.running: list[str] = []
        self._lock = threading.Lock()
        self._wait_task: object | None = None

    def _describe(self) -> str:
        now = ", ".join(self.running[:2]) or "..."
        return f"compiling {now}"

    def waiting(self, owner: str, waited_s: float) -> None:
        if self._wait_task is None:
            self.progress.start()
            self._wait_task = self.progress.add_task(
                f"waiting for another process building plugserve's CPU kernels ({owner})",
                total=None,
            )

    def begin(self, jobs: int, cached: int, isas: list[str], started: float) -> None:
        self.console.print(_headline(self.reason, isas, jobs, cached))
        if self._wait_task is None:
            self.progress.start()
        else:
            self.progress.remove_task(self._wait_task)  # type: ignore[arg-type]
        self.task = self.progress.add_task(self._describe(), total=jobs)

    def _update(self, advance: int = 0) -> None:
        self.progress.update(self.task, description=self._describe(),  # type: ignore[arg-type]
                             advance=advance)

    def job_started(self, label: str) -> None:
        with self._lock:
            self.running.append(label)
            self._update()

    def job_done(self, label: str, seconds: float) -> None:
        with self._lock:
            if label in self.running:
                self.running.remove(label)
            self._update(advance=1)

    def job_failed(self, label: str) -> None:
        self.job_done(label, 0.0)

    def linking(self) -> None:
        with self._lock:
            self.progress.update(self.task, description="linking")  # type: ignore[arg-type]

    def end(self, seconds: float, path: Path) -> None:
        self.progress.update(self.task, description=f"ready in {seconds:.0f} s")  # type: ignore[arg-type]

    def close(self) -> None:
        self.progress.stop()


def for_stderr(reason: str) -> BuildStatus:
    """A rich status on a terminal, plain lines elsewhere."""
    if sys.stderr.isatty():
        return RichStatus(reason)
    return LineStatus(reason)
