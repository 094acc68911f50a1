"""Checks `plugserve bench` makes before any engine starts: options that do not apply to the
chosen workload, the workload's options dataclass, and that `--plot` can be written."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from plugserve.cli.errors import UsageError

WORKLOAD_OPTIONS: dict[str, tuple[str, ...]] = {
    # workload -> its own options (each refused by the others)
    "throughput": ("num_seqs", "max_input_len", "max_output_len", "seed", "structured"),
    "prefill": ("num_seqs", "input_len", "num_iters", "seed"),
    "shared-prefix": (
        "groups", "prompts_per_group", "prefix_len", "question_len", "output_len", "seed",
    ),
    "spec": ("spec_prompts", "output_len"),
    "sessions": ("sessions", "turns", "turn_input_len", "turn_output_len", "seed",
                 "background_prompts", "background_len"),
    "long-context": ("num_seqs", "output_len", "seed"),
    "latency": ("batch_size", "input_len", "output_len", "num_iters", "num_iters_warmup",
                "seed"),
}


def refuse_foreign_options(
    workload: str,
    engine_fields_set: tuple[str, ...],
    engine_values: dict[str, Any],
    workload_values: dict[str, Any],
) -> None:
    """Options the chosen workload would ignore or override are errors, not silent no-ops."""
    flag = "--{}".format
    overridden = [flag(k.replace("_", "-")) for k in engine_fields_set
                  if engine_values.get(k) is not None]
    if overridden:
        raise UsageError(
            f"bench {workload} chooses {', '.join(overridden)} itself; leave "
            f"{'it' if len(overridden) == 1 else 'them'} out"
        )
    own = WORKLOAD_OPTIONS[workload]
    foreign = [flag(k.replace("_", "-")) for k, v in workload_values.items()
               if v is not None and k not in own]
    if foreign:
        raise UsageError(
            f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to bench "
            f"{workload}; its options: {', '.join(flag(k.replace('_', '-')) for k in own)}"
        )


def bench_workload_options(workload: str, values: dict[str, Any]) -> Any:
    """The workload's options dataclass from the options given (defaults for the rest)."""
    from plugserve.bench.shared_prefix import SharedPrefixOptions
    from plugserve.bench.spec import SpecOptions
    from plugserve.bench.throughput import ThroughputOptions

    given = {k: v for k, v in values.items() if v is not None}
    if workload == "throughput":
        return ThroughputOptions(**given)
    if workload == "prefill":
        from plugserve.bench.prefill import PrefillOptions

        return PrefillOptions(**given)
    if workload == "shared-prefix":
        return SharedPrefixOptions(**given)
    if workload == "long-context":
        from plugserve.bench.long_context import LongContextOptions

        return LongContextOptions(**given)
    if workload == "latency":
        from plugserve.bench.latency import LatencyOptions

        return LatencyOptions(**given)
    if workload == "sessions":
        from plugserve.bench.sessions import SessionsOptions

        return SessionsOptions(**given)
    if "spec_prompts" in given:
        given["num_prompts"] = given.pop("spec_prompts")
    return SpecOptions(**given)


def plot_path_problem(path: Path) -> str | None:
    """Why `--plot PATH` could not be written after the run, or None when it can."""
    if path.is_dir():
        return "it is a folder; give a file name such as " + str(path / "bench.png")
    folder = path.parent
    if not folder.exists():
        return f"its folder {str(folder)!r} does not exist; create it first"
    if not folder.is_dir():
        return f"{str(folder)!r} is not a folder"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file exists and is not writable"
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {str(folder)!r} is not writable"
    if importlib.util.find_spec("matplotlib") is None:
        return "drawing it needs matplotlib, which is not installed (pip install matplotlib)"
    return None


def check_plot_path(path: Path | None) -> None:
    """Refuse a `--plot` file the run could not write, before the run, not after it."""
    if path is None:
        return
    problem = plot_path_problem(path)
    if problem is not None:
        raise UsageError(f"--plot {str(path)!r} cannot be written: {problem}")


COMPARISONS = ("transformers", "vllm", "llamacpp")


def parse_compare(compare: str | None, vllm_python: Path | None,
                  llamacpp_python: Path | None = None, workload: str = "throughput",
                  ) -> tuple[str, ...]:
    """`--compare transformers,vllm` (or `llamacpp` for bench latency): the implementations
    to time besides the engine, each with its interpreter where it needs one."""
    from plugserve.bench.llamacpp import SETUP_HINT as LLAMACPP_HINT
    from plugserve.bench.vllm import SETUP_HINT

    chosen = tuple(part.strip() for part in (compare or "").split(",") if part.strip())
    for part in chosen:
        if part not in COMPARISONS:
            raise UsageError(f"--compare {part!r} is not supported; allowed: "
                             f"{', '.join(COMPARISONS)}")
    if "vllm" in chosen and vllm_python is None:
        raise UsageError(f"--compare vllm needs --vllm-python PATH, an interpreter with vLLM: "
                         f"{SETUP_HINT}")
    if vllm_python is not None and "vllm" not in chosen:
        raise UsageError("--vllm-python applies only with --compare vllm")
    if "llamacpp" in chosen and llamacpp_python is None:
        raise UsageError(f"--compare llamacpp needs --llamacpp-python PATH, an interpreter "
                         f"with llama-cpp-python: {LLAMACPP_HINT}")
    if llamacpp_python is not None and "llamacpp" not in chosen:
        raise UsageError("--llamacpp-python applies only with --compare llamacpp")
    if workload == "latency" and set(chosen) - {"llamacpp"}:
        raise UsageError("bench latency compares with llama.cpp only (--compare llamacpp)")
    if "llamacpp" in chosen and workload != "latency":
        raise UsageError(f"--compare llamacpp applies to bench latency, not {workload}")
    return tuple(dict.fromkeys(chosen))


def checked_llamacpp(python: Path | None, config: Any) -> tuple[Any, Path]:
    """The `--compare llamacpp` run and the GGUF file both sides load, checked before any
    engine starts."""
    from plugserve.bench.llamacpp import LlamaCppComparison, LlamaCppError, gguf_file_of

    assert python is not None  # parse_compare refuses --compare llamacpp without it
    comparison = LlamaCppComparison(python)
    try:
        model = gguf_file_of(config.model)
        comparison.check(str(config.device))
    except LlamaCppError as exc:
        raise UsageError(str(exc)) from None
    return comparison, model


def add_llamacpp_run(report: dict[str, Any], checked: tuple[Any, Path], runner: Any) -> None:
    """Run llama.cpp on the engine's first prompt and add its figures to the report."""
    from plugserve.bench.latency import add_llamacpp
    from plugserve.bench.llamacpp import LlamaCppError

    comparison, model = checked
    try:
        add_llamacpp(report, comparison, model, runner)
    except LlamaCppError as exc:
        raise UsageError(str(exc)) from None


def checked_vllm(python: Path | None, config: Any, workload: str) -> Any:
    """The `--compare vllm` run, its interpreter checked before any engine starts."""
    from plugserve.bench.vllm import VllmComparison, VllmError

    assert python is not None  # parse_compare refuses --compare vllm without it
    comparison = VllmComparison(python)
    try:
        comparison.check(config, workload)
    except VllmError as exc:
        raise UsageError(str(exc)) from None
    return comparison


def add_vllm_run(report: dict[str, Any], comparison: Any, runner: Any) -> None:
    """Run vLLM on the first timed run's requests and add its figures to the report."""
    from plugserve.bench.vllm import VllmError, add_vllm_comparison

    try:
        result = comparison.run_measured(runner, runner.measured)
    except VllmError as exc:
        raise UsageError(str(exc)) from None
    add_vllm_comparison(report, result, runner.measured)


def refuse_under_torchrun(config: Any) -> None:
    """A benchmark starts several engines one after the other; torchrun's ranks follow one."""
    if config.tp_size > 1 and os.environ.get("RANK") is not None:
        raise UsageError("bench starts several engines and cannot run under torchrun; run it "
                         "without torchrun: --tp N starts the ranks on this machine")
