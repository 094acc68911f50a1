"""Tensor parallelism on torch.distributed: ranks, process groups, identical schedulers.

`EngineConfig.tp_size` > 1 splits the model's heads, MLP and vocabulary over ranks
(`plugserve.model.tp_layers`); each rank holds its own KV pools for its heads and runs the same
scheduler and KV manager on the same requests. Rank 0 takes requests and tells the others what
changed before each step (`leader`, `channel`, `follower`); every rank's KV accounting is
compared after every step (`cross_check`). Ranks start here (`launch`, `runtime`): the engine
spawns them on one machine, or joins torchrun's across machines.
"""

from __future__ import annotations

from plugserve.parallel.launch import (
    TensorParallelError,
    TensorParallelStartError,
    is_follower_rank,
)

__all__ = ["TensorParallelError", "TensorParallelStartError", "is_follower_rank"]
