"""Processes a test started, found through /proc: what is still alive, and ending it all.

Every test here that starts ranks must leave nothing behind, also when it fails. The ranks
the engine spawns are this process's descendants; a command line started for a test runs in
a session (process group) of its own, ended as a whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

# Python's own helper process for spawned children: one per process, it ends with it.
_HELPERS = ("multiprocessing.resource_tracker",)


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, process group, state) of a live process, None if it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    state, ppid, pgrp = fields[0], int(fields[1]), int(fields[2])
    return None if state in ("Z", "X") else (ppid, pgrp, state)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int | None = None) -> set[int]:
    """Live descendants of `root` (default: this process), Python's helpers left out."""
    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None:
            parents[pid] = st[0]
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - out
        out |= frontier
    return {pid for pid in out if not any(h in _cmdline(pid) for h in _HELPERS)}


def in_group(pgid: int) -> set[int]:
    """Live processes of process group `pgid`."""
    return {pid for pid in _all_pids() if (st := _stat(pid)) is not None and st[1] == pgid}


def wait_gone(pids: Iterable[int], timeout_s: float) -> set[int]:
    """Wait up to `timeout_s` for every pid to end; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    left = {p for p in pids if _stat(p) is not None}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if _stat(p) is not None}
    return left


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group(proc: subprocess.Popen[bytes]) -> set[int]:
    """SIGKILL the session `proc` leads; returns what was still alive before (left behind)."""
    left = in_group(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    wait_gone(left, 10.0)
    return left
