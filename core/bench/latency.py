"""Workload `latency` (vLLM's `bench latency`): one batch of B random prompts of I tokens,
O output tokens each (greedy, EOS ignored), run `num_iters` times after `num_iters_warmup`
untimed runs; the prefix cache is emptied before each, so every run prefills in full.

Per iteration: latency (submit to the last token), prefill = submit to the batch's last
first token (B*I tokens), decode = from there to the last token (B*(O-1) tokens). Reported:
the mean latency and its percentiles, the median prefill and decode tok/s, and the share of
the roofline the decode reaches: bytes per step / the read bandwidth measured in this run
(before and after the engine's runs and after llama.cpp's; the highest reading, the stricter
bound). The bytes are the GGUF file's tensors as stored (the quantized roofline) when the
model is a GGUF file or the built-in default one, else the loaded weights'.

`--compare llamacpp --llamacpp-python PY` runs the same file and the first prompt through
llama.cpp with the same thread count (plugserve.bench.llamacpp; batch 1 there) and adds
its figures, the ratios and the agreement of the first 32 greedy tokens.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugserve.bench.bandwidth import (
    gguf_bytes_per_token,
    measure_bandwidth,
    roofline_fraction,
    weight_bytes,
)
from plugserve.bench.runner import BenchOptionsError, new_report
from plugserve.bench.throughput import TOKEN_ID_MAX

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.llamacpp import LlamaCppComparison
    from plugserve.bench.runner import Measured, Runner
    from plugserve.config import EngineConfig

NAME = "latency"
ENGINE_FIELDS_SET: tuple[str, ...] = ()  # runs the command's engine configuration as is
PERCENTILES = (10, 25, 50, 75, 90, 99)
FIRST_TOKENS = 32


@dataclass(frozen=True)
class LatencyOptions:
    batch_size: int = 1
    input_len: int = 128
    output_len: int = 128
    num_iters: int = 3
    num_iters_warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name, least in (("batch_size", 1), ("input_len", 1), ("output_len", 2),
                            ("num_iters", 1), ("num_iters_warmup", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")


def make_prompts(options: LatencyOptions, vocab_size: int) -> list[list[int]]:
    """B prompts of I random ids below min(vocab, 10001), from `random.Random(seed)`."""
    rng = random.Random(options.seed)
    top = min(int(vocab_size) - 1, TOKEN_ID_MAX)
    return [[rng.randint(0, top) for _ in range(options.input_len)]
            for _ in range(options.batch_size)]


def engine_configs(base: EngineConfig, options: LatencyOptions) -> dict[str, EngineConfig]:
    return {"plugserve": base}


def iteration_times(measured: Measured) -> dict[str, float]:
    """Latency, prefill and decode seconds of one timed batch."""
    reqs = measured.reqs
    start = min(r.created_s for r in reqs)
    first = max(float(r.first_token_s or start) for r in reqs)
    end = max(float(r.finished_s or first) for r in reqs)
    return {"latency_s": measured.seconds, "prefill_s": first - start, "decode_s": end - first}


def run(runner: Runner, options: LatencyOptions, comparison: Comparison | None) -> dict[str, Any]:
    import torch

    from plugserve.sampling import SamplingParams

    if comparison is not None:
        raise BenchOptionsError("bench latency compares with llama.cpp only "
                                "(--compare llamacpp)")
    readings = [measure_bandwidth()]
    threads = torch.get_num_threads()
    report = new_report(runner, {"name": NAME, **options.__dict__, "threads": threads})
    b, i, o = options.batch_size, options.input_len, options.output_len
    with runner.engine("plugserve") as engine:
        prompts = make_prompts(options, int(engine.arch.vocab_size))
        params = [SamplingParams(max_new_tokens=o, ignore_eos=True)] * b
        for _ in range(options.num_iters_warmup):
            engine.generate(prompts, params[0])
        measured = [runner.measure(engine, f"iteration {k + 1}", prompts, params)
                    for k in range(options.num_iters)]
        loaded_bytes = _loaded_weight_bytes(engine)
    readings.append(measure_bandwidth())
    times = [iteration_times(m) for m in measured]
    latencies = [t["latency_s"] for t in times]
    median = sorted(range(len(measured)), key=lambda k: latencies[k])[len(measured) // 2]
    run_doc = {**measured[median].metrics(), "name": "plugserve", "settings": {}}
    report["runs"].append(run_doc)
    report["latency"] = {"plugserve": {
        "batch_size": b,
        "latency_s": latencies,
        "avg_latency_s": statistics.mean(latencies),
        "percentiles_s": {f"p{q}": _percentile(latencies, q) for q in PERCENTILES},
        "prefill_s": [t["prefill_s"] for t in times],
        "decode_s": [t["decode_s"] for t in times],
        "prefill_tok_per_s": statistics.median(b * i / t["prefill_s"] for t in times),
        "decode_tok_per_s": statistics.median(b * (o - 1) / t["decode_s"] for t in times),
        "first_tokens": measured[0].outputs[0][:FIRST_TOKENS],
        "prompt": measured[0].prompts[0],
    }}
    report["bandwidth"] = {"read_gb_s_readings": [r["read_gb_s"] for r in readings],
                           "copy_gb_s": max(r["copy_gb_s"] for r in readings)}
    report["roofline"] = _roofline_basis(runner.config.model, loaded_bytes)
    finish_roofline(report)
    return report


def add_llamacpp(report: dict[str, Any], comparison: LlamaCppComparison, model: Path,
                 runner: Runner) -> None:
    """Run llama.cpp on the engine's first prompt, measure the bandwidth once more, and add
    its figures, the ratios and the greedy agreement to the report."""
    from plugserve.bench.vllm import agreement

    work, mine = report["workload"], report["latency"]["plugserve"]
    with runner.status("llama.cpp: loading and generating"):
        theirs = comparison.run(model, mine["prompt"], int(work["output_len"]),
                                int(work["threads"]), int(work["num_iters"]),
                                int(work["num_iters_warmup"]))
    report["llamacpp"] = theirs
    report["bandwidth"]["read_gb_s_readings"].append(measure_bandwidth()["read_gb_s"])
    report["vs_llamacpp"] = {
        kind: _ratio(mine.get(f"{kind}_tok_per_s"), theirs.get(f"{kind}_tok_per_s"))
        for kind in ("decode", "prefill")
    }
    report["agreement"] = agreement([mine["first_tokens"]], [theirs["first_tokens"]],
                                    comparison.first_tokens)
    finish_roofline(report)


def finish_roofline(report: dict[str, Any]) -> None:
    """The bound and each side's share of it, from the highest bandwidth reading so far.
    At batch B a decode step reads the weights once for B tokens: the share is steps/s."""
    bandwidth = report["bandwidth"]
    bandwidth["read_gb_s"] = max(bandwidth["read_gb_s_readings"])
    roofline = report["roofline"]
    per_token = int(roofline["bytes_per_token"])
    roofline["bound_steps_per_s"] = (bandwidth["read_gb_s"] * 1e9 / per_token
                                     if per_token > 0 else None)
    mine = report["latency"]["plugserve"]
    roofline["plugserve"] = roofline_fraction(
        mine["decode_tok_per_s"] / mine["batch_size"], per_token, bandwidth["read_gb_s"])
    if "llamacpp" in report:
        roofline["llamacpp"] = roofline_fraction(report["llamacpp"].get("decode_tok_per_s"),
                                                 per_token, bandwidth["read_gb_s"])


def _roofline_basis(model: str | None, loaded_bytes: int | None) -> dict[str, Any]:
    gguf: Path | None = None
    if model is None:
        from plugserve.model.default_model import default_gguf_path

        gguf = default_gguf_path()
    elif str(model).lower().endswith(".gguf"):
        gguf = Path(model).expanduser()
    basis: dict[str, Any] = {"engine_weight_bytes_per_token": loaded_bytes}
    if gguf is not None:
        basis.update(source="gguf tensors", file=str(gguf), **gguf_bytes_per_token(gguf))
    else:
        basis.update(source="loaded weights", bytes_per_token=loaded_bytes or 0)
    return basis


def _loaded_weight_bytes(engine: Any) -> int | None:
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "embed_tokens"):
        return None  # a tensor-parallel engine keeps its model in the ranks
    return weight_bytes(model)[0]


def _percentile(values: list[float], q: int) -> float | None:
    from plugserve.bench.metrics import percentile

    return percentile(values, q)


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return mine / theirs if mine and theirs else None


def print_tables(report: dict[str, Any]) -> None:
    """The latency summary after the standard tables."""
    from plugserve.bench.latency_report import print_latency

    print_latency(report)
