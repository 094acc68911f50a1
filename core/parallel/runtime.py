"""`TensorParallel`: one engine's ranks, their process groups, and how they stop.

Start-up, on every rank, before any weight is read: the model's shape must split over the
ranks (`tp_problems`), rank 0 opens the rendezvous (a port in use is an error) and starts
the others, every rank joins the default group, and the ranks compare what they were started
with (`startup_checks`: the same world size, configuration and model, one device type).

Process groups (gloo for everything the scheduler thread sends; the model's own backend,
gloo on the CPU and nccl on CUDA, for the forward thread's collectives). Collectives from two
threads on one group would interleave (gloo pairs them by order), so each thread has its own:

| group | thread | what | timeout |
|---|---|---|---|
| model | forward (worker under overlap) | all-reduces, logits gather, sampled ids | tp_timeout_s |
| command | scheduler | rank 0's commands before each step | rank 0's sends: tp_timeout_s; a follower waits without one (it idles there) |
| check | scheduler | the cross-rank check of the KV terms | tp_timeout_s |

Stopping: `close()` after rank 0's last command; `fail(exc)` when a step failed (the rank that
went away is named, the other ranks are ended).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plugserve.model.tp_shard import CollectiveError, ModelShard, tp_problems
from plugserve.parallel import launch, startup_checks
from plugserve.parallel.channel import CommandChannel
from plugserve.parallel.launch import RankPlace, TensorParallelError, TensorParallelStartError

if TYPE_CHECKING:
    from plugserve.config import EngineConfig
    from plugserve.model.arch import ModelArchConfig

log = logging.getLogger("plugserve.parallel")

NO_TIMEOUT = timedelta(days=3650)  # a follower waits for rank 0's next command this long
# Start-up (importing, reading the configuration, loading a shard) may take much longer than a
# step; a rank that dies meanwhile is seen at once (its exit, or its closed connection).
START_TIMEOUT_S = 600.0
READY_POLL_S = 0.1
CLOSE_GRACE_S = 10.0


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds in memory: its weights (its shard, plus what is replicated) and
    its KV pools' buffers (its KV heads of every slot)."""

    weights_bytes: int
    kv_pool_bytes: int
    kv_pool_slots: int

    @classmethod
    def of(cls, model: torch.nn.Module, kv_pool: Any, kv_pool_slots: int) -> RankMemory:
        from plugserve.model.weight_bytes import weight_bytes

        # quantized weights as their blocks; the buffers (rope tables) as well
        weights = weight_bytes(model) + sum(t.numel() * t.element_size()
                                            for t in model.buffers())
        kv = sum(t.numel() * t.element_size()
                 for t in [*kv_pool.k_buffer.values(), *kv_pool.v_buffer.values()])
        return cls(weights, kv, kv_pool_slots)

    def describe(self) -> str:
        mib = 1 << 20
        return (f"{self.weights_bytes / mib:.1f} MiB of weights and "
                f"{self.kv_pool_bytes / mib:.1f} MiB of KV pool ({self.kv_pool_slots} slots)")


class TensorParallel:
    """This process's rank of one tensor-parallel engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, place: RankPlace, arch: ModelArchConfig,
                 children: Any, watch: launch.ChildWatch | None) -> None:
        self.config = config
        self.place = place
        self.rank = place.rank
        self.world_size = place.world_size
        self.children = children
        self.watch = watch
        timeout = timedelta(seconds=config.tp_timeout_s)
        self.backend = model_backend(config)
        self.model_group = dist.new_group(backend=self.backend, timeout=timeout)
        self.command_group = dist.new_group(backend="gloo", timeout=NO_TIMEOUT)
        self.check_group = dist.new_group(backend="gloo", timeout=timeout)
        self.shard = ModelShard(self.rank, self.world_size, arch, self.model_group)
        self.channel = CommandChannel(self.command_group, self.rank, config.tp_timeout_s)
        self.device = rank_device(config, place)
        self._closed = False
        # Why a failed step ended this engine when another rank was to blame (`fail`), kept
        # for `problem` where the watch did not see the rank go (a stopped, not dead, rank).
        self._failed_problem: str | None = None
        self.memory_per_rank: list[RankMemory] = []

    # --- start-up ---------------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig, arch: ModelArchConfig, plugins: Sequence[str],
              engine_cls: Any) -> TensorParallel:
        """Join (or, as rank 0, start) the world of `config.tp_size` ranks (the ones started
        here build an `engine_cls`). Raises TensorParallelStartError before any weight is read
        when they cannot work together."""
        place = launch.rank_place(config.tp_size)
        problems = tp_problems(arch, place.world_size)
        problems += backend_problems(config)
        if problems:
            raise TensorParallelStartError(
                "tensor parallelism cannot run this configuration:\n"
                + "\n".join(f"  - {p}" for p in problems))
        timeout = timedelta(seconds=max(config.tp_timeout_s, START_TIMEOUT_S))
        children = watch = None
        if place.spawned:  # a child rank 0 started: it says it is ready, then joins
            assert place.master_port is not None
            store = dist.TCPStore(place.master_addr, place.master_port, place.world_size,
                                  is_master=False, timeout=timeout)
            store.set(launch.READY_KEY.format(rank=place.rank), "1")
            dist.init_process_group("gloo", store=store, rank=place.rank,
                                    world_size=place.world_size, timeout=timeout)
        elif place.launched:  # torchrun's rank: MASTER_ADDR / MASTER_PORT name its store
            if place.master_port is None:
                raise TensorParallelStartError(
                    "MASTER_PORT is not set: start the ranks with torchrun (it sets "
                    "MASTER_ADDR and MASTER_PORT)")
            dist.init_process_group("gloo", init_method="env://", rank=place.rank,
                                    world_size=place.world_size, timeout=timeout)
        else:
            store = launch.master_store(place, place.world_size, timeout.total_seconds())
            children = launch.spawn_ranks(engine_cls, config, plugins, place.master_addr,
                                          store.port, place.world_size)
            watch = launch.ChildWatch(children)
            try:
                _wait_until_ready(store, watch, place.world_size, timeout.total_seconds())
                dist.init_process_group("gloo", store=store, rank=0,
                                        world_size=place.world_size, timeout=timeout)
            except BaseException:
                watch.stop()
                watch.end_all()
                raise
        try:
            problems = startup_checks.compare_ranks(config, arch, place)
            if problems:
                raise TensorParallelStartError(
                    "the tensor-parallel ranks were started differently:\n"
                    + "\n".join(f"  - {p}" for p in problems))
            return cls(config, place, arch, children, watch)
        except BaseException:
            _end(children, watch)
            _destroy()
            raise

    # --- what the engine builds -------------------------------------------------------------
    @property
    def leads(self) -> bool:
        """Rank 0 takes requests and sends each step's commands; the others follow."""
        return self.rank == 0

    def record(self, command: tuple[Any, ...]) -> None:
        """Rank 0: a change of the scheduler's work made outside a step (a request queued or
        aborted, a session opened or closed); the followers make it before the next step."""
        self.channel.pending.append(command)

    def share_memory_for_all_reduce(self) -> None:
        """After the CPU kernels are loaded, on every rank: the model's all-reduces go
        through shared memory when all ranks are on this machine (`shm_setup`)."""
        from plugserve.parallel.shm_setup import share_memory

        self.shard.shm = share_memory(
            self.rank, self.world_size, enabled=self.config.tp_shm_all_reduce,
            device_type=self.device.type, backend=self.backend,
            timeout_s=self.config.tp_timeout_s, group=self.check_group)

    def wait_for_all_built(self, memory: RankMemory) -> None:
        """Every rank has its shard and its KV memory (however long loading took): from here
        on the ranks step together and a late one is a hung one. The ranks exchange what
        each holds (`memory_per_rank`, logged by rank 0)."""
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, memory, group=self.command_group)
        except RuntimeError as exc:
            raise self.fail(CollectiveError(
                f"waiting for the tensor-parallel ranks to load failed on rank {self.rank}: "
                f"{str(exc).splitlines()[0]}")) from exc
        self.memory_per_rank = list(gathered)
        if self.leads:
            for rank, held in enumerate(self.memory_per_rank):
                log.info("tensor-parallel rank %d of %d holds %s", rank, self.world_size,
                         held.describe())

    def stats(self) -> dict[str, Any]:
        """This rank's place, what every rank holds, and the seconds this rank's forwards
        spent in the model's collectives (all-reduces, gathers, broadcasts: the waits for the
        other ranks included)."""
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "all_reduce": "shared memory" if self.shard.shm is not None else self.backend,
                "collectives_s": self.shard.comm_s,
                "memory_per_rank": [dataclasses.asdict(m) for m in self.memory_per_rank]}

    @property
    def closed(self) -> bool:
        """The process groups are gone (closed, or abandoned after a failure)."""
        return self._closed

    def problem(self) -> str | None:
        """Why this engine cannot serve any more because of another rank (None: all up)."""
        seen = None if self.watch is None else self.watch.problem
        return seen or self._failed_problem

    # --- stopping ---------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> BaseException:
        """A step failed on this rank: end the other ranks and return the error to raise. A
        failed collective becomes a TensorParallelError naming the rank that went away."""
        problem = None
        if isinstance(exc, CollectiveError) and self.watch is not None:
            problem = self.watch.wait_for_failure(timeout_s=5.0)
        if isinstance(exc, CollectiveError) and problem is None:
            others = [r for r in range(self.world_size) if r != self.rank]
            which = "rank" if len(others) == 1 else "ranks"
            problem = (f"tensor-parallel {which} {', '.join(map(str, others))} did not answer "
                       f"(dead, or stuck past tp_timeout_s={self.config.tp_timeout_s:g} s)")
        self.close(abandon=True)
        if problem is None:
            return exc
        self._failed_problem = problem
        error = TensorParallelError(f"{problem}; the engine stopped ({exc})")
        error.__cause__ = exc
        return error

    def close(self, abandon: bool = False) -> None:
        """Rank 0 after its last command (or `abandon`: after a failure): wait for the other
        ranks to end (ending them if they do not), then leave the process groups."""
        if self._closed:
            return
        self._closed = True
        if self.watch is not None:
            self.watch.stop()
            if not abandon:
                _join(self.children, CLOSE_GRACE_S)
            self.watch.end_all()
            _remove_error_files(self.children)
        _destroy()


def model_backend(config: EngineConfig) -> str:
    if config.tp_backend is not None:
        return config.tp_backend
    return "nccl" if config.device.startswith("cuda") else "gloo"


def backend_problems(config: EngineConfig) -> list[str]:
    backend = model_backend(config)
    problems = []
    if backend == "nccl" and not config.device.startswith("cuda"):
        problems.append(f"tp_backend 'nccl' needs CUDA tensors; device is {config.device!r} "
                        "(use gloo on the CPU)")
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    if not available[backend]:
        problems.append(f"torch.distributed backend {backend!r} is not available in this "
                        f"PyTorch build ({torch.__version__})")
    if config.device.startswith("cuda:") and config.tp_size > 1:
        problems.append(f"device {config.device!r}: with tp_size > 1 each rank uses "
                        "cuda:LOCAL_RANK; pass --device cuda")
    return problems


def rank_device(config: EngineConfig, place: RankPlace) -> torch.device:
    if config.device == "cuda":
        return torch.device("cuda", place.local_rank)
    return torch.device(config.device)


def _wait_until_ready(store: Any, watch: launch.ChildWatch, world_size: int,
                      timeout_s: float) -> None:
    """Rank 0 waits for every child to reach its rendezvous (they import and read their
    configuration first), failing as soon as one dies."""
    import time

    keys = [launch.READY_KEY.format(rank=r) for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if watch.problem is not None:
            raise TensorParallelStartError(watch.problem)
        if time.monotonic() > deadline:
            raise TensorParallelStartError(
                f"the tensor-parallel ranks did not start within {timeout_s:g} s")
        time.sleep(READY_POLL_S)


def _join(children: Any, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    for p in children.processes:
        p.join(max(0.0, deadline - time.monotonic()))


def _end(children: Any, watch: launch.ChildWatch | None) -> None:
    if watch is not None:
        watch.stop()
        watch.end_all()


def _remove_error_files(children: Any) -> None:
    for path in getattr(children, "error_files", ()):
        if path and os.path.exists(path):
            os.unlink(path)


def _destroy() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group with a dead peer may not close cleanly
            log.warning("leaving the process groups: %s", exc)
