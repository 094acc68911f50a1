"""Workload `shared-prefix`: groups of prompts behind a shared system prefix, radix cache on/off.

G groups x P prompts; each group has its own random prefix of S tokens and each prompt adds
its own random Q-token question; O output tokens each, EOS ignored. Token ids come from
`random.Random(seed)` in the throughput workload's range (0..10000). All G*P requests are
submitted at once, to an engine with `cache="radix"` and then to one with `cache="none"`.

Reported: the prefill tokens each engine computed (the `prefill_tokens` counter over the
run), the total prompt tokens G*P*(S+Q) and the unique ones G*S + G*P*Q, and the mean TTFT
with the cache over the mean TTFT without. Targets (reported, not enforced): computed with
the cache <= 1.1x unique, TTFT ratio <= 0.3.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plugserve.bench.runner import derive, new_report
from plugserve.bench.throughput import TOKEN_ID_MAX

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.runner import Runner
    from plugserve.config import EngineConfig

NAME = "shared-prefix"
CACHES = ("radix", "none")
ENGINE_FIELDS_SET = ("cache",)
COMPUTED_TARGET = 1.1  # computed prefill tokens / unique prompt tokens, with the cache
TTFT_TARGET = 0.3  # mean TTFT with the cache / without


@dataclass(frozen=True)
class SharedPrefixOptions:
    groups: int = 8
    prompts_per_group: int = 8
    prefix_len: int = 512
    question_len: int = 32
    output_len: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("groups", "prompts_per_group", "prefix_len", "question_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def total_prompt_tokens(self) -> int:
        return self.groups * self.prompts_per_group * (self.prefix_len + self.question_len)

    @property
    def unique_prompt_tokens(self) -> int:
        return self.groups * (self.prefix_len + self.prompts_per_group * self.question_len)


def make_prompts(options: SharedPrefixOptions) -> list[list[int]]:
    """Group-major: the P prompts of group 0, then those of group 1, ..."""
    rng = random.Random(options.seed)
    prompts = []
    for _ in range(options.groups):
        prefix = [rng.randint(0, TOKEN_ID_MAX) for _ in range(options.prefix_len)]
        for _ in range(options.prompts_per_group):
            prompts.append(prefix + [rng.randint(0, TOKEN_ID_MAX)
                                     for _ in range(options.question_len)])
    return prompts


def engine_configs(base: EngineConfig, options: SharedPrefixOptions) -> dict[str, EngineConfig]:
    return {cache: derive(base, cache=cache) for cache in CACHES}


def run(
    runner: Runner, options: SharedPrefixOptions, comparison: Comparison | None
) -> dict[str, Any]:
    from plugserve.sampling import SamplingParams

    prompts = make_prompts(options)
    report = new_report(
        runner,
        {
            "name": NAME,
            "groups": options.groups,
            "prompts_per_group": options.prompts_per_group,
            "prefix_len": options.prefix_len,
            "question_len": options.question_len,
            "output_len": options.output_len,
            "seed": options.seed,
            "prompt_tokens": options.total_prompt_tokens,
            "unique_prompt_tokens": options.unique_prompt_tokens,
            "output_tokens": len(prompts) * options.output_len,
        },
    )
    params = [SamplingParams(max_new_tokens=options.output_len, ignore_eos=True)] * len(prompts)
    # A warm-up prompt that shares nothing with the workload (the cache is emptied anyway).
    warmup = [TOKEN_ID_MAX - i for i in range(16)]
    engine_prompts: list[list[int]] = []
    for label, config in engine_configs(runner.config, options).items():
        with runner.engine(f"cache={label}", config, warmup=warmup) as engine:
            vocab = int(engine.arch.vocab_size)
            engine_prompts = [[t % vocab for t in p] for p in prompts]
            measured = runner.measure(engine, f"cache={label}", engine_prompts, params)
        computed = measured.counters.get("prefill_tokens", 0)
        report["runs"].append({
            **measured.metrics(),
            "settings": {"cache": label},
            "prefill_tokens_computed": computed,
            "computed_over_unique": computed / options.unique_prompt_tokens,
        })
    report["summary"] = summarize(report["runs"], options)
    if comparison is not None:
        from plugserve.bench.hf import add_comparison

        add_comparison(
            report, comparison.run(runner, engine_prompts, [options.output_len] * len(prompts))
        )
    return report


def summarize(runs: list[dict[str, Any]], options: SharedPrefixOptions) -> dict[str, Any]:
    by_cache = {r["settings"]["cache"]: r for r in runs}
    with_cache, without = by_cache["radix"], by_cache["none"]
    ttft_on, ttft_off = with_cache["ttft_s"]["mean"], without["ttft_s"]["mean"]
    ratio = ttft_on / ttft_off if ttft_on is not None and ttft_off else None
    computed = with_cache["prefill_tokens_computed"]
    return {
        "prompt_tokens_total": options.total_prompt_tokens,
        "prompt_tokens_unique": options.unique_prompt_tokens,
        "prefill_tokens_computed": {r["settings"]["cache"]: r["prefill_tokens_computed"]
                                    for r in runs},
        "ttft_mean_s": {"radix": ttft_on, "none": ttft_off},
        "ttft_ratio": ratio,
        "targets": {
            "computed_le_1.1x_unique": computed <= COMPUTED_TARGET * options.unique_prompt_tokens,
            "ttft_ratio_le_0.3": ratio is not None and ratio <= TTFT_TARGET,
        },
    }
