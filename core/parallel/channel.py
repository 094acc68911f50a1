"""Rank 0's commands to the other ranks, one message before each scheduler call.

A message is what the followers must do to their scheduler to stay identical to rank 0's:
the changes rank 0 made between two steps (`pending`: requests queued or aborted, sessions
opened or closed, in order) and the scheduler call that follows (`STEP`, `IDLE`, `CLOSE`).
It is one broadcast of a small int64 header on the command group; the commands, when there
are any, follow as a second broadcast of their pickled bytes.

The command group has no timeout, because a follower waits there for as long as rank 0 idles.
Rank 0's sends are bounded instead: each waits at most `send_timeout_s` for the followers to
take it (a stopped or stuck follower fails the send, and the engine, in bounded time).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plugserve.model.tp_shard import CollectiveError

STEP, IDLE, CLOSE = 1, 2, 3
OP_NAMES = {STEP: "step", IDLE: "idle", CLOSE: "close"}


class CommandChannel:
    def __init__(self, group: Any, rank: int, send_timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.send_timeout = timedelta(seconds=send_timeout_s)
        self.pending: list[tuple[Any, ...]] = []  # rank 0: recorded since the last message

    def send(self, op: int) -> None:
        """Rank 0: the pending commands and the call about to be made."""
        payload = pickle.dumps(self.pending) if self.pending else b""
        self.pending = []
        header = torch.tensor([op, len(payload)], dtype=torch.int64)
        self._broadcast(header, self.send_timeout)
        if payload:
            self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8),
                            self.send_timeout)

    def receive(self) -> tuple[int, list[tuple[Any, ...]]]:
        """A follower: wait (however long rank 0 idles) for the next message."""
        header = torch.empty(2, dtype=torch.int64)
        self._broadcast(header)
        op, size = (int(v) for v in header.tolist())
        if not size:
            return op, []
        data = torch.empty(size, dtype=torch.uint8)
        self._broadcast(data)
        commands: list[tuple[Any, ...]] = pickle.loads(data.numpy().tobytes())
        return op, commands

    def _broadcast(self, tensor: torch.Tensor, timeout: timedelta | None = None) -> None:
        try:
            if timeout is None:
                dist.broadcast(tensor, 0, group=self.group)
                return
            work = dist.broadcast(tensor, 0, group=self.group, async_op=True)
            assert work is not None
            work.wait(timeout=timeout)
        except RuntimeError as exc:
            raise CollectiveError(f"rank 0's command to the tensor-parallel ranks failed on "
                                  f"rank {self.rank}: {str(exc).splitlines()[0]}") from exc
