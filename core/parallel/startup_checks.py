"""The ranks compare what they were started with, once, before any weight is read.

Every rank sends the same small description (its world size, device type, the model's shape
and the configuration that decides the schedule) to every other (`all_gather_object` on the
default group), so each finds the same problems and every rank refuses with the same error.
Identical schedulers on every rank are only identical if they were configured identically.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from plugserve.config import EngineConfig
    from plugserve.model.arch import ModelArchConfig
    from plugserve.parallel.launch import RankPlace

# May differ between ranks: where the model lives on each machine, which GPU index, how long
# to wait, and the plugin allowlist (the selected plugins' names are compared as config).
PER_RANK_FIELDS = frozenset({"model", "tokenizer", "device", "plugins", "tp_timeout_s"})


def describe(config: EngineConfig, arch: ModelArchConfig, place: RankPlace) -> dict[str, Any]:
    settings = {k: v for k, v in config.model_dump().items() if k not in PER_RANK_FIELDS}
    settings["revert_fixes"] = sorted(settings["revert_fixes"])
    return {
        "rank": place.rank,
        "world_size": place.world_size,
        "device": config.device.split(":")[0],
        "arch": {k: repr(v) for k, v in dataclasses.asdict(arch).items()},
        "config": settings,
    }


def device_mix_problem(devices: list[str]) -> str | None:
    """Every rank must compute on the same kind of device (None when they do)."""
    if len(set(devices)) <= 1:
        return None
    listed = ", ".join(f"rank {r} on {d}" for r, d in enumerate(devices))
    return (f"the ranks mix device types ({listed}): every tensor-parallel rank must run on "
            "the same kind of device (all cpu with gloo, or all cuda with nccl)")


def rank_problems(descriptions: list[dict[str, Any]]) -> list[str]:
    """What differs between the ranks' descriptions (empty = they agree)."""
    problems = []
    first = descriptions[0]
    for d in descriptions[1:]:
        r = d["rank"]
        if d["world_size"] != first["world_size"]:
            problems.append(f"world size mismatch: rank {r} expects {d['world_size']} ranks, "
                            f"rank 0 expects {first['world_size']}")
        differ = sorted(k for k in first["config"] if d["config"].get(k) != first["config"][k])
        if differ:
            shown = ", ".join(f"{k}={d['config'].get(k)!r} (rank 0: {first['config'][k]!r})"
                              for k in differ[:6])
            problems.append(f"rank {r} was configured differently: {shown}")
        arch_differ = sorted(k for k in first["arch"] if d["arch"].get(k) != first["arch"][k])
        if arch_differ:
            shown = ", ".join(f"{k}={d['arch'].get(k)} (rank 0: {first['arch'][k]})"
                              for k in arch_differ[:6])
            problems.append(f"rank {r} loads a different model: {shown}")
    mix = device_mix_problem([d["device"] for d in descriptions])
    if mix is not None:
        problems.append(mix)
    return problems


def compare_ranks(config: EngineConfig, arch: ModelArchConfig, place: RankPlace) -> list[str]:
    """All-gather every rank's description and return what differs (same list on every
    rank)."""
    mine = describe(config, arch, place)
    gathered: list[Any] = [None] * place.world_size
    dist.all_gather_object(gathered, mine)
    return rank_problems(sorted(gathered, key=lambda d: d["rank"]))
