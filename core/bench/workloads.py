"""The workloads `plugserve bench` can run, by name.

Each workload module has `NAME`, an options dataclass, `ENGINE_FIELDS_SET` (engine options
it chooses itself, so the command refuses them), `engine_configs(base, options)` (every
engine it will start, checked before any model loads) and `run(runner, options, comparison)`
returning the JSON report.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from plugserve.bench import (
    latency,
    long_context,
    prefill,
    sessions,
    shared_prefix,
    spec,
    throughput,
)

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.runner import Runner
    from plugserve.config import EngineConfig


SERVING = "serving"  # against a running server: no engine here (plugserve.bench.serving)


@dataclass(frozen=True)
class Workload:
    module: ModuleType
    summary: str

    @property
    def name(self) -> str:
        return str(self.module.NAME)

    @property
    def engine_fields_set(self) -> tuple[str, ...]:
        return tuple(self.module.ENGINE_FIELDS_SET)

    def engine_configs(self, base: EngineConfig, options: Any) -> dict[str, EngineConfig]:
        return dict(self.module.engine_configs(base, options))

    def run(self, runner: Runner, options: Any, comparison: Comparison | None) -> dict[str, Any]:
        return dict(self.module.run(runner, options, comparison))


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(throughput, "random prompts and output lengths, all at once"),
        Workload(shared_prefix, "groups sharing a system prefix; radix cache on vs off"),
        Workload(spec, "chat prompts; plain vs EAGLE chain vs tree, page 1/16, batch 1/8"),
        Workload(sessions, "multi-turn conversations; streaming sessions vs re-sent history"),
        Workload(long_context, "long prompts on a hybrid SWA model; SWA pools vs one pool"),
        Workload(prefill, "prompts of one length, one output token: prefill speed"),
        Workload(latency, "one batch of fixed lengths, timed iterations: prefill and decode"),
    )
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; choose one of: {', '.join([*WORKLOADS, SERVING])}"
        ) from None
