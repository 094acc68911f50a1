"""Workload `prefill`: N prompts of exactly L random tokens (default one of 1,024), one output
token each, all submitted at once: the time is the prefill's. Input tok/s is the figure;
with one output token per request the output tok/s ratio to another implementation is the
same ratio. `--compare vllm` / `transformers` run the same prompts.

Before the timed run the engine prefills one other prompt of the same length (another seed's
tokens, so nothing is shared through the prefix cache): the first pass at a new size pays
one-time costs (the heap growing to its size, GEMM buffers), which vLLM pays in its start-up
profiling run.

`--num-iters N` (vLLM's `bench latency` name) times N prefills, each of new prompts (seeds
further on: nothing shared), one after the other, and reports the median one; vLLM runs the
same N sets of prompts. One prefill of 1,024 tokens is a fifth of a second, which a busy host
moves by 10-20%: the median of several is the figure to compare.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plugserve.bench.throughput import TOKEN_ID_MAX, Workload, run_workload

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.runner import Runner
    from plugserve.config import EngineConfig

NAME = "prefill"
ENGINE_FIELDS_SET: tuple[str, ...] = ()  # runs the command's engine configuration as is


@dataclass(frozen=True)
class PrefillOptions:
    num_seqs: int = 1
    input_len: int = 1024
    num_iters: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_seqs < 1:
            raise ValueError(f"num_seqs must be >= 1, got {self.num_seqs}")
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len}")
        if self.num_iters < 1:
            raise ValueError(f"num_iters must be >= 1, got {self.num_iters}")


def make_workload(options: PrefillOptions, seed_offset: int = 0) -> Workload:
    rng = random.Random(options.seed + seed_offset)
    prompts = [[rng.randint(0, TOKEN_ID_MAX) for _ in range(options.input_len)]
               for _ in range(options.num_seqs)]
    return Workload(prompts, [1] * options.num_seqs)


def engine_configs(base: EngineConfig, options: PrefillOptions) -> dict[str, EngineConfig]:
    return {"plugserve": base}


def run(runner: Runner, options: PrefillOptions, comparison: Comparison | None) -> dict[str, Any]:
    header = {"name": NAME, "num_seqs": options.num_seqs, "input_len": options.input_len,
              "seed": options.seed}
    if options.num_iters > 1:
        header["num_iters"] = options.num_iters
    warm = make_workload(PrefillOptions(1, options.input_len, seed=options.seed), seed_offset=1)
    # Further iterations: seeds past the warm-up's (offset 1).
    more = [make_workload(options, seed_offset=1 + i) for i in range(1, options.num_iters)]
    return run_workload(runner, header, make_workload(options), comparison,
                        warm_prompt=warm.prompts[0], more_iterations=more)
