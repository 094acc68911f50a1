"""Workload `spec`: speculative decoding on chat prompts, against plain decoding.

The first `--spec-prompts` prompts of `data/chat_prompts.jsonl` (cycled when more are asked
for), wrapped in the model's chat template, N new tokens each, greedy, EOS ignored. Matrix:
method (plain, EAGLE chain: 3 steps x topk 1, EAGLE tree: 3 steps x topk 4 with 8 draft
tokens) x page size (1, 16) x batch (1: one request at a time, 8: up to 8 in flight). One
engine per method and page size; its prefix cache is emptied before each timed run.

Reported per configuration besides the serving metrics:
- acceptance length: tokens per verify round, (accepted + rounds) / rounds;
- target forwards per output token: per request (1 prefill + verify rounds) / output tokens,
  averaged over requests (1.0 without speculation: one forward per token);
- speedup vs plain: output tok/s over plain's at the same page size and batch;
- lossless: greedy speculation must give exactly plain's tokens (same page size and batch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from plugserve.bench.runner import derive, new_report

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.runner import Measured, Runner
    from plugserve.config import EngineConfig

NAME = "spec"
PROMPTS_FILE = "chat_prompts.jsonl"
PAGE_SIZES = (1, 16)
BATCH_SIZES = (1, 8)
# method -> engine fields
METHODS: dict[str, dict[str, Any]] = {
    "plain": {"spec": "none", "spec_topk": 1, "spec_draft_tokens": None, "draft_model": None},
    "chain": {"spec": "eagle", "spec_steps": 3, "spec_topk": 1, "spec_draft_tokens": None},
    "tree": {"spec": "eagle", "spec_steps": 3, "spec_topk": 4, "spec_draft_tokens": 8},
}
ENGINE_FIELDS_SET = ("spec", "page_size", "spec_steps", "spec_topk", "spec_draft_tokens")


@dataclass(frozen=True)
class SpecOptions:
    num_prompts: int = 8
    output_len: int = 64
    draft_model: str | None = None  # None: the engine's default (a head shipped for the model)

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"spec_prompts must be >= 1, got {self.num_prompts}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


def load_chat_prompts(n: int) -> list[str]:
    """The first n prompts of the shipped file, cycled when n is larger."""
    text = resources.files("plugserve.bench").joinpath("data", PROMPTS_FILE).read_text("utf-8")
    prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    if not prompts:
        raise RuntimeError(f"{PROMPTS_FILE} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


def label(method: str, page_size: int, batch: int | None = None) -> str:
    text = f"{method} page={page_size}"
    return text if batch is None else f"{text} batch={batch}"


def engine_configs(base: EngineConfig, options: SpecOptions) -> dict[str, EngineConfig]:
    return {
        label(method, page): derive(
            base, page_size=page, **fields,
            **({} if method == "plain" else {"draft_model": options.draft_model}),
        )
        for page in PAGE_SIZES
        for method, fields in METHODS.items()
    }


def run(runner: Runner, options: SpecOptions, comparison: Comparison | None) -> dict[str, Any]:
    from plugserve.sampling import SamplingParams

    prompts = load_chat_prompts(options.num_prompts)
    report = new_report(
        runner,
        {
            "name": NAME,
            "prompts": options.num_prompts,
            "output_len": options.output_len,
            "page_sizes": list(PAGE_SIZES),
            "batch_sizes": list(BATCH_SIZES),
            "methods": METHODS,
            "draft_model": options.draft_model,
            "output_tokens": options.num_prompts * options.output_len,
        },
    )
    params = [SamplingParams(max_new_tokens=options.output_len, ignore_eos=True)] * len(prompts)
    measured: dict[tuple[str, int, int], Measured] = {}
    configs = engine_configs(runner.config, options)
    for page in PAGE_SIZES:
        # The speculative engines first: a missing draft model stops the bench at once.
        for method in sorted(METHODS, key=lambda m: m == "plain"):
            with runner.engine(label(method, page), configs[label(method, page)],
                               warmup=prompts[0]) as engine:
                for batch in BATCH_SIZES:
                    measured[method, page, batch] = runner.measure(
                        engine, label(method, page, batch), prompts, params, chat=True,
                        concurrency=batch,
                    )
    for page in PAGE_SIZES:
        for batch in BATCH_SIZES:
            for method in METHODS:
                report["runs"].append(spec_run(measured[method, page, batch], method, page,
                                               batch, measured["plain", page, batch]))
    report["summary"] = summarize(report["runs"])
    if comparison is not None:
        from plugserve.bench.hf import add_comparison

        reference = measured["plain", PAGE_SIZES[0], BATCH_SIZES[0]]
        add_comparison(
            report, comparison.run(runner, reference.prompts, [options.output_len] * len(prompts))
        )
    return report


def spec_run(
    measured: Measured, method: str, page: int, batch: int, plain: Measured
) -> dict[str, Any]:
    out = measured.metrics(spec=True)
    base_rate = plain.metrics()["output_tok_per_s"] if plain is not measured else None
    rate = out["output_tok_per_s"]
    return {
        **out,
        "settings": {"method": method, "page_size": page, "batch_size": batch,
                     **METHODS[method]},
        "speedup_vs_plain": rate / base_rate if rate and base_rate else 1.0,
        "lossless": measured.outputs == plain.outputs,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    batch1 = {
        label(r["settings"]["method"], r["settings"]["page_size"]): r["speedup_vs_plain"]
        for r in runs
        if r["settings"]["batch_size"] == 1 and r["settings"]["method"] != "plain"
    }
    return {
        "lossless": all(r["lossless"] for r in runs),
        "batch1_speedup_vs_plain": batch1,
        "accept_len": {r["name"]: r["accept_len"] for r in runs if r["accept_len"] is not None},
    }
