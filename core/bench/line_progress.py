"""Progress as plain lines, for a benchmark whose stderr is not a terminal (a log, a pipe, CI).

rich's bar draws nothing there, so a long run would be silent until its report. This keeps the
bar's small API (`add_task`, `advance`, `remove_task`): every `every_s` seconds a daemon thread
prints a line per running task with its elapsed time (and count), so a step that blocks (a
model load, a compile, a compared engine's run) still shows it is alive, and a counted task
(a timed request set) that ran that long prints one line when it ends. A task shorter than
`every_s` prints nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

HEARTBEAT_S = 10.0


@dataclass
class _Task:
    description: str
    total: int | None
    started_s: float
    completed: int = 0


class LineProgress:
    """A heartbeat line per running task every `every_s` seconds, an end line per long counted
    task (see the module)."""

    def __init__(self, console: Any, every_s: float = HEARTBEAT_S) -> None:
        self.console = console
        self.every_s = every_s
        self._tasks: dict[int, _Task] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LineProgress:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="plugserve-bench-progress",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def add_task(self, description: str, total: int | None = None) -> int:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
            self._tasks[task_id] = _Task(description, total, time.monotonic())
        return task_id

    def advance(self, task_id: int, advance: int = 1) -> None:
        with self._lock:
            task = self._tasks.get(task_id)
            if task is not None:
                task.completed += advance

    def remove_task(self, task_id: int) -> None:
        with self._lock:
            task = self._tasks.pop(task_id, None)
        # An end line only where heartbeats were printed: a short task prints nothing.
        if (task is not None and task.total is not None
                and time.monotonic() - task.started_s >= self.every_s):
            self._say(f"{task.description}: done{self._count(task)} in "
                      f"{time.monotonic() - task.started_s:.1f} s")

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                lines = [f"{t.description}: {time.monotonic() - t.started_s:.0f} s"
                         f"{self._count(t)}" for t in self._tasks.values()]
            for line in lines:
                self._say(line)

    @staticmethod
    def _count(task: _Task) -> str:
        return "" if task.total is None else f", {task.completed}/{task.total}"

    def _say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False)
