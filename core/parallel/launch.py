"""Where the ranks come from: this process's place in the world, and starting the others.

On one machine the engine starts the other N-1 ranks itself with `torch.multiprocessing`
(spawn): rank 0 is the caller's process and hosts the rendezvous store, each child runs
`_rank_main`. Across machines the same program runs under `torchrun`, which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; every process then finds its rank in the
environment (the children the engine starts get the same variables).

A child never outlives rank 0: a watchdog thread ends it when its parent process is gone, and
rank 0 watches its children (`ChildWatch`) and ends the others when one dies.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("plugserve.parallel")

# Set in the ranks the engine starts itself (not in torchrun's).
SPAWNED_ENV = "PLUGSERVE_TP_SPAWNED"
READY_KEY = "plugserve/ready/{rank}"
FAILED_KEY = "plugserve/failed/{rank}"
PARENT_POLL_S = 0.5


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank cannot go on (it died, hung or failed); the message names it."""


class TensorParallelStartError(TensorParallelError):
    """The ranks cannot start together (bad shape, port in use, world size or devices that do
    not match); raised before any weight is read."""


@dataclass(frozen=True)
class RankPlace:
    """This process's place: `launched` = its rank came from the environment (torchrun, or a
    child the engine started); otherwise it is rank 0 and starts the others itself."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int | None
    launched: bool
    spawned: bool  # a child the engine started (its parent is rank 0)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise TensorParallelStartError(f"{name}={value!r} is not an integer") from None


def rank_place(tp_size: int) -> RankPlace:
    """Read RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. Without RANK this is
    rank 0 of `tp_size`, starting the others; with it, WORLD_SIZE must equal `tp_size`."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _env_int("MASTER_PORT")
    if rank is None:
        return RankPlace(0, tp_size, 0, addr, port, launched=False, spawned=False)
    if world is None:
        raise TensorParallelStartError("RANK is set but WORLD_SIZE is not: start the ranks with "
                                       "torchrun, or unset RANK to let the engine start them")
    if world != tp_size:
        raise TensorParallelStartError(
            f"world size mismatch: this rank was launched with WORLD_SIZE={world} but "
            f"tp_size={tp_size} (--tp / PLUGSERVE_TP_SIZE); launch exactly tp_size ranks "
            "(torchrun --nnodes x --nproc-per-node = tp_size) or pass --tp "
            f"{world}")
    if not 0 <= rank < world:
        raise TensorParallelStartError(f"RANK={rank} is outside WORLD_SIZE={world}")
    local = _env_int("LOCAL_RANK")
    return RankPlace(rank, world, rank if local is None else local, addr, port, launched=True,
                     spawned=os.environ.get(SPAWNED_ENV) == "1")


def is_follower_rank() -> bool:
    """True in a process whose environment makes it a rank > 0 (torchrun, or a child the
    engine started): such a process follows rank 0 instead of taking requests."""
    rank = os.environ.get("RANK")
    return rank is not None and rank.isdigit() and int(rank) > 0


def master_store(place: RankPlace, world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on MASTER_ADDR:MASTER_PORT (a free port when MASTER_PORT is
    unset). A port in use is a clear error, before any rank starts."""
    from datetime import timedelta

    import torch.distributed as dist

    port = place.master_port or 0
    if port:
        problem = _port_problem(place.master_addr, port)
        if problem is not None:
            raise TensorParallelStartError(problem)
    try:
        return dist.TCPStore(place.master_addr, port, world_size, is_master=True,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise TensorParallelStartError(
            f"cannot start the tensor-parallel rendezvous on {place.master_addr}:{port}: "
            f"{str(exc).splitlines()[0]}; set MASTER_PORT to a free port (or unset it to let "
            "the engine pick one)") from exc


def _port_problem(addr: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, port))
        except OSError as exc:
            return (f"MASTER_PORT={port} on {addr} cannot be used for the tensor-parallel "
                    f"rendezvous: {exc.strerror or exc}; set MASTER_PORT to a free port (or "
                    "unset it to let the engine pick one)")
    return None


# --- the children ------------------------------------------------------------------------


def spawn_ranks(engine_cls: Any, config: Any, plugins: Sequence[str], addr: str, port: int,
                world_size: int) -> Any:
    """Start ranks 1..world_size-1 (spawned processes, daemonic) and return torch's
    `ProcessContext`. Each builds an `engine_cls` and runs with as many threads as this
    process."""
    import torch
    import torch.multiprocessing as mp

    return mp.start_processes(
        _rank_main, args=(engine_cls, config, tuple(plugins), addr, port, world_size,
                          torch.get_num_threads(), os.getpid()),
        nprocs=world_size - 1, join=False, daemon=True, start_method="spawn")


def _rank_main(index: int, engine_cls: Any, config: Any, plugins: tuple[str, ...], addr: str,
               port: int, world_size: int, threads: int, parent: int) -> None:
    """A child rank: place itself in the world, build its engine, follow rank 0 (process
    `parent`)."""
    import torch

    rank = index + 1
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "MASTER_ADDR": addr,
                       "MASTER_PORT": str(port), SPAWNED_ENV: "1"})
    torch.set_num_threads(threads)
    watch_parent(parent)
    from plugserve.parallel.follower import run_follower_rank

    run_follower_rank(engine_cls, config, plugins)


def watch_parent(parent: int) -> None:
    """End this process when its parent (rank 0, process `parent`) is gone, whatever this
    process is doing. The pid comes from rank 0 itself: rank 0 may die while this process is
    still importing, before it could ask for its parent (it would get its new parent, init)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.error("rank 0 (process %d) is gone: this rank stops", parent)
        os._exit(1)

    threading.Thread(target=watch, name="plugserve-parent-watch", daemon=True).start()


class ChildWatch:
    """Rank 0's watchdog over the ranks it started: the first one that ends before it was
    asked to is recorded (`problem`, naming the rank and why), and the others are ended."""

    def __init__(self, context: Any, poll_s: float = 0.2) -> None:
        self.context = context
        self.poll_s = poll_s
        self.problem: str | None = None
        self.failed_rank: int | None = None
        self._stopping = threading.Event()
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plugserve-rank-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            for index, process in enumerate(self.context.processes):
                if process.exitcode is not None and not self._stopping.is_set():
                    self._record(index + 1, process.exitcode, index)
                    self.end_all()
                    return
            time.sleep(self.poll_s)

    def _record(self, rank: int, exitcode: int, index: int) -> None:
        if exitcode < 0:
            import signal

            try:
                how = f"killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"killed by signal {-exitcode}"
        else:
            how = f"exited with code {exitcode}"
        detail = _child_error(self.context, index)
        self.failed_rank = rank
        self.problem = f"tensor-parallel rank {rank} {how}" + (f": {detail}" if detail else "")
        log.error("%s", self.problem)
        self._changed.set()

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """The recorded problem, waiting up to `timeout_s` for one (a collective can fail a
        moment before the dead child's exit is seen)."""
        self._changed.wait(timeout_s)
        return self.problem

    def end_all(self, grace_s: float = 5.0) -> None:
        """Terminate every child still running; kill those still there after `grace_s`."""
        processes = list(self.context.processes)
        for p in processes:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5.0)

    def stop(self) -> None:
        """The ranks are being closed on purpose: stop watching (exits are expected now)."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)


def _child_error(context: Any, index: int) -> str:
    """The last line of the exception a child raised (torch's spawn writes it to a file)."""
    import pickle

    try:
        path = context.error_files[index]
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            return ""
        with open(path, "rb") as f:
            text = str(pickle.load(f))
    except Exception:
        return ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
