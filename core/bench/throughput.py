"""Workload `throughput`: a fixed random workload, greedy, EOS ignored (nano-vllm's shape).

The workload is `random.seed(0)`; 64 prompts of `randint(16, 256)` random token ids in
0..10000, then 64 output lengths `randint(16, 256)`: 9,536 prompt and 8,224 output tokens.
All requests are submitted at once to one engine with the command's configuration;
`--compare transformers` runs the same prompts as left-padded batches.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plugserve.bench.gemm_peak import gemm_share, measure_peak
from plugserve.bench.runner import new_report

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.runner import Runner
    from plugserve.config import EngineConfig

NAME = "throughput"
TOKEN_ID_MAX = 10000
MIN_LEN = 16
# (num_seqs, max_input_len, max_output_len, seed) -> (prompt tokens, output tokens)
CHECKSUMS = {(64, 256, 256, 0): (9536, 8224)}
ENGINE_FIELDS_SET: tuple[str, ...] = ()  # runs the command's engine configuration as is
STRUCTURED_KINDS = ("none", "json")
# What `--structured json` constrains every output to: records of an extraction, at least 16
# of them (over 256 tokens), so the grammar never ends a request before its output length and
# every run keeps its batch size.
STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 16, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                       "score": {"type": "number"},
                       "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "name", "score", "tags"]}}},
    "required": ["records"],
}


@dataclass(frozen=True)
class ThroughputOptions:
    num_seqs: int = 64
    max_input_len: int = 256
    max_output_len: int = 256
    seed: int = 0
    # "json": every request's output is constrained by STRUCTURED_SCHEMA (the grammar mask's
    # cost per step is reported); "none": free.
    structured: str = "none"

    def __post_init__(self) -> None:
        if self.structured not in STRUCTURED_KINDS:
            raise ValueError(f"structured must be one of {', '.join(STRUCTURED_KINDS)}, got "
                             f"{self.structured!r}")
        if self.num_seqs < 1:
            raise ValueError(f"num_seqs must be >= 1, got {self.num_seqs}")
        for name in ("max_input_len", "max_output_len"):
            if getattr(self, name) < MIN_LEN:
                raise ValueError(f"{name} must be >= {MIN_LEN}, got {getattr(self, name)}")


BenchOptions = ThroughputOptions  # the name before there were several workloads


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_new: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new)

    def within_vocab(self, vocab_size: int) -> Workload:
        """Fold ids into a smaller vocabulary (tiny test models); lengths do not change."""
        if vocab_size > TOKEN_ID_MAX:
            return self
        return Workload([[t % vocab_size for t in p] for p in self.prompts], self.max_new)


def make_workload(options: ThroughputOptions) -> Workload:
    """The random workload; the default one must match its known token totals."""
    rng = random.Random(options.seed)
    prompts = [
        [rng.randint(0, TOKEN_ID_MAX) for _ in range(rng.randint(MIN_LEN, options.max_input_len))]
        for _ in range(options.num_seqs)
    ]
    max_new = [rng.randint(MIN_LEN, options.max_output_len) for _ in range(options.num_seqs)]
    workload = Workload(prompts, max_new)
    key = (options.num_seqs, options.max_input_len, options.max_output_len, options.seed)
    expected = CHECKSUMS.get(key)
    got = (workload.prompt_tokens, workload.output_tokens)
    if expected is not None and got != expected:
        raise RuntimeError(f"workload checksum mismatch: got {got} tokens, expected {expected}")
    return workload


def engine_configs(base: EngineConfig, options: ThroughputOptions) -> dict[str, EngineConfig]:
    return {"plugserve": base}


def run(
    runner: Runner, options: ThroughputOptions, comparison: Comparison | None
) -> dict[str, Any]:
    workload = make_workload(options)
    header = {
        "name": NAME,
        "num_seqs": options.num_seqs,
        "max_input_len": options.max_input_len,
        "max_output_len": options.max_output_len,
        "seed": options.seed,
        "structured": options.structured,
    }
    return run_workload(runner, header, workload, comparison, structured=options.structured)


def run_workload(
    runner: Runner, header: dict[str, Any], workload: Workload, comparison: Comparison | None,
    warm_prompt: list[int] | None = None, structured: str = "none",
    more_iterations: Sequence[Workload] = (),
) -> dict[str, Any]:
    """Every request of `workload` submitted at once to one engine with the command's
    configuration, then the comparison (if any) on the same prompts. `warm_prompt`, when
    given, is generated (one token) before the timed run, after the usual short warm-up.
    `more_iterations` (workloads of the same lengths) are timed after it the same way; the
    run reported is then the median of all (`iteration_seconds` lists each), and vLLM runs
    the same iterations (`--compare transformers` times the first one's prompts only)."""
    from plugserve.sampling import SamplingParams

    report = new_report(
        runner,
        {**header, "prompt_tokens": workload.prompt_tokens,
         "output_tokens": workload.output_tokens},
    )
    with runner.engine("plugserve", warmup=workload.prompts[0]) as engine:
        work = workload.within_vocab(int(engine.arch.vocab_size))
        grammar = None
        if structured == "json":
            from plugserve.structured import GrammarSpec

            grammar = GrammarSpec.json_schema(STRUCTURED_SCHEMA)
        params = [SamplingParams(max_new_tokens=m, ignore_eos=True, structured_outputs=grammar)
                  for m in work.max_new]
        if grammar is not None:  # the grammar compiled (once, cached) before the clock starts
            engine.generate([work.prompts[0]],
                            SamplingParams(max_new_tokens=2, structured_outputs=grammar))
        if warm_prompt is not None:
            vocab = int(engine.arch.vocab_size)
            engine.generate([[t % vocab for t in warm_prompt]],
                            SamplingParams(max_new_tokens=1, ignore_eos=True))
        # The GEMM peak just before the timed run (and again after it, in gemm_share).
        peak_before = measure_peak(engine.model, engine.dtype, engine.device)
        measured = runner.measure(engine, "plugserve", work.prompts, params)
        vocab = int(engine.arch.vocab_size)
        iterations = [measured] + [
            runner.measure(engine, "plugserve", more.within_vocab(vocab).prompts, params,
                           iteration=i)
            for i, more in enumerate(more_iterations, start=1)
        ]
        median = sorted(iterations, key=lambda m: m.seconds)[(len(iterations) - 1) // 2]
        metrics = median.metrics()
        # The workload's share of the machine's GEMM peak, measured now, on this engine.
        report["gemm"] = gemm_share(engine, [len(p) for p in work.prompts], work.max_new,
                                    float(metrics["seconds"]), peak_before)
    run_doc = {**metrics, "settings": {}}
    if more_iterations:
        run_doc["iteration_seconds"] = [m.seconds for m in iterations]
    if grammar is not None:
        run_doc["grammar_mask"] = grammar_mask_figures(measured)
    report["runs"].append(run_doc)
    if comparison is not None:
        from plugserve.bench.hf import add_comparison

        add_comparison(report, comparison.run(runner, measured.prompts, work.max_new))
    return report


def grammar_mask_figures(measured: Any) -> dict[str, Any]:
    """The grammar mask's time per step and its share of the step (wall time per step)."""
    steps = max(1, int(measured.counters.get("steps", 0)))
    mask_s = float(measured.step_time_s.get("grammar_mask", 0.0))
    step_s = measured.seconds / steps
    return {"steps": steps, "mask_ms_per_step": 1e3 * mask_s / steps,
            "step_ms": 1e3 * step_s, "share_of_step": mask_s / measured.seconds
            if measured.seconds > 0 else None}
