"""One rank's share of a tensor-parallel model, and the collectives its layers call.

The split is vLLM's and SGLang's: every rank holds `num_attention_heads / N` query heads and
`intermediate_size / N` MLP columns; KV heads are split the same way, or, when there are
fewer KV heads than ranks, each rank holds the one KV head its query heads read (replicated
`N / num_key_value_heads` times). The vocabulary is split into `ceil(vocab / N)` rows per rank
(the last rank's tail padded with zero rows). A shape that N does not divide is refused with
the sizes that would divide it (`tp_problems`), before anything is loaded.

The collectives run on the *model* process group, from the thread that runs forwards. A
failed or timed-out collective raises `CollectiveError`, which the engine turns into an error
naming the rank that went away.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plugserve.kernels.shm_all_reduce import RankMissing, SharedMemoryAllReduce
from plugserve.model.arch import ModelArchConfig


class CollectiveError(RuntimeError):
    """A collective with the other ranks failed: a rank died, hung past the timeout or the
    connection broke. The message says which collective and why."""


def _sizes_dividing(arch: ModelArchConfig) -> list[int]:
    return [n for n in range(1, arch.num_attention_heads + 1) if not _shape_problems(arch, n)]


def _shape_problems(arch: ModelArchConfig, n: int) -> list[str]:
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    out = []
    if n > heads:
        out.append(f"tp_size {n} is larger than the model's {heads} attention heads")
    elif heads % n:
        out.append(f"num_attention_heads ({heads}) is not divisible by tp_size {n}")
    if kv_heads >= n and kv_heads % n:
        out.append(f"num_key_value_heads ({kv_heads}) is not divisible by tp_size {n}")
    if kv_heads < n and n % kv_heads:
        out.append(f"tp_size {n} is not a multiple of num_key_value_heads ({kv_heads}), so "
                   "the KV heads cannot be replicated evenly")
    if arch.intermediate_size % n:
        out.append(f"intermediate_size ({arch.intermediate_size}) is not divisible by "
                   f"tp_size {n}")
    return out


def tp_problems(arch: ModelArchConfig, tp_size: int) -> list[str]:
    """Why `arch` cannot be split over `tp_size` ranks (empty = it can), each naming the tp
    sizes that would work."""
    problems = _shape_problems(arch, tp_size)
    if not problems:
        return []
    fits = ", ".join(map(str, _sizes_dividing(arch)))
    return [f"{p}; tp sizes this model can use: {fits}" for p in problems]


@dataclass
class ModelShard:
    """Rank `rank` of `size`: which part of every weight it holds, and the model's collectives
    (on `group`). `comm_s` counts the seconds spent in them (a forward's share)."""

    rank: int
    size: int
    arch: ModelArchConfig  # the whole model's shape
    group: Any = None  # the model process group; None only when size == 1
    comm_s: float = field(default=0.0, compare=False)
    # The all-reduces through shared memory when every rank is on one machine (set by
    # TensorParallel at start-up); None: through `group`'s backend.
    shm: SharedMemoryAllReduce | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        problems = tp_problems(self.arch, self.size)
        if problems:
            raise ValueError("; ".join(problems))
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.size} ranks")

    # --- what this rank holds ---------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.arch.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.arch.num_key_value_heads // self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.heads

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds; with fewer KV heads than ranks, the one its
        query heads read (query head h reads KV head h // (heads / kv_heads))."""
        kv = self.arch.num_key_value_heads
        if kv >= self.size:
            return self.rank * self.kv_heads
        return self.first_head // (self.arch.num_attention_heads // kv)

    @property
    def intermediate(self) -> int:
        return self.arch.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows every rank holds (the last rank's tail is zero padding)."""
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The token ids [start, stop) this rank's embedding and LM head rows stand for."""
        start = min(self.rank * self.vocab_rows, self.arch.vocab_size)
        return start, min(start + self.vocab_rows, self.arch.vocab_size)

    def local_arch(self) -> ModelArchConfig:
        """The model's shape as this rank holds it: its heads, MLP columns and vocabulary rows
        (what the layers, the KV pool and the attention backend are sized from)."""
        return dataclasses.replace(
            self.arch, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate, vocab_size=self.vocab_rows,
        )

    # --- collectives --------------------------------------------------------------------------
    def _run(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as exc:
            raise CollectiveError(f"tensor-parallel {what} on rank {self.rank} failed: "
                                  f"{str(exc).splitlines()[0]}") from exc
        finally:
            self.comm_s += time.perf_counter() - t0

    def _through_shm(self, what: str, fn: Any, tensor: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            out: torch.Tensor = fn(tensor)
            return out
        except RankMissing as exc:
            raise CollectiveError(f"tensor-parallel {what} on rank {self.rank} failed: "
                                  f"{exc}") from exc
        finally:
            self.comm_s += time.perf_counter() - t0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.size == 1:
            return tensor
        if self.shm is not None and self.shm.applies(tensor):
            return self._through_shm("all-reduce", self.shm.all_reduce_, tensor)
        self._run("all-reduce", dist.all_reduce, tensor)
        return tensor

    def gather_last_dim(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's `local` [..., counts[rank]] joined along the last dim in rank order
        (ranks may hold different counts: each is padded to the largest for the transfer)."""
        if self.size == 1:
            return local
        width = max(counts)
        if local.shape[-1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        if self.shm is not None and self.shm.gathers(local) and counts == [width] * self.size:
            return self._through_shm("all-gather", self.shm.all_gather, local)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self._run("all-gather", dist.all_gather, parts, local.contiguous())
        return torch.cat([p[..., :c] for p, c in zip(parts, counts, strict=True)], dim=-1)

    def gather_vocab(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab_rows] logits of this rank's vocabulary -> [rows, vocab] on every
        rank, identical bits everywhere."""
        counts = [self.vocab_rows] * self.size
        return self.gather_last_dim(local_logits, counts)[..., : self.arch.vocab_size]

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `tensor` into every rank's (same shape and dtype), in place."""
        if self.size > 1:
            self._run("broadcast", dist.broadcast, tensor, src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` (picklable) on every rank: two small broadcasts (size, bytes)."""
        if self.size == 1:
            return obj
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self.broadcast_(size, src)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == src
                else torch.empty(int(size.item()), dtype=torch.uint8))
        self.broadcast_(data, src)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())
