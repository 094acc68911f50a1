"""`plugserve bench serving`: options checked, the benchmark run, the report printed.

Kept apart from `plugserve.cli.bench` (the offline workloads); that command hands over here
when the workload is `serving`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from plugserve.cli.bench import write_plot
from plugserve.cli.bench_options import check_plot_path
from plugserve.cli.errors import UsageError
from plugserve.cli.options import print_json


def run_serving(values: dict[str, Any], offline: dict[str, Any], plot: Path | None,
                json_out: bool) -> None:
    """`bench serving`: the online benchmark against a running server."""
    import os

    from plugserve.bench import serving

    if offline.get("compare") == "vllm":
        run_vllm_comparison(values, offline, json_out)
        return
    given = [f"--{k.replace('_', '-')}" for k, v in offline.items() if v]
    if given:
        raise UsageError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply "
                         "to bench serving: it measures a running server (configure that one "
                         "with plugserve serve)")
    check_plot_path(plot)
    try:
        api_key = os.environ.get("PLUGSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        options = serving.options_from_cli(values, api_key)
        import httpx  # noqa: F401
    except ValueError as exc:
        raise UsageError(f"invalid benchmark options: {exc}") from None
    except ImportError:
        raise UsageError("bench serving needs httpx: pip install httpx") from None
    try:
        report = serving.run(options, None if json_out else
                             lambda name: typer.echo(f"bench serving: {name} ...", err=True))
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    if plot is not None:
        report["plot"] = str(write_plot(report, plot))
    if json_out:
        print_json(report)
        return
    from plugserve.bench.report import print_report

    print_report(report)
    if plot is not None:
        typer.echo(f"plot written to {report['plot']}", err=True)


def run_vllm_comparison(values: dict[str, Any], offline: dict[str, Any], json_out: bool) -> None:
    """`bench serving --compare vllm`: vLLM's `vllm bench serve` against `plugserve serve` and
    vLLM's server, one at a time, and the engine offline (plugserve.bench.serving_vllm)."""
    import math

    from plugserve.bench import serving_vllm

    allowed = {"compare", "model", "dtype", "vllm_python"}
    given = [f"--{k.replace('_', '-')}" for k, v in offline.items() if v and k not in allowed]
    if values.get("base_url"):
        given.append("--base-url")
    if given:
        raise UsageError(f"{', '.join(given)} do(es) not apply to bench serving --compare vllm: "
                         "it starts both servers itself (--model, --dtype, --vllm-python, "
                         "--num-seqs, --input-len, --output-len, --request-rate, --dataset, "
                         "--stream-interval)")
    python = offline.get("vllm_python")
    if python is None:
        raise UsageError("--compare vllm needs --vllm-python (benchmarks/setup_vllm.sh makes "
                         ".venv-vllm/bin/python)")
    interval = values.get("stream_interval")
    if interval is not None and interval < 1:
        raise UsageError(f"--stream-interval must be at least 1 (tokens per streamed chunk), "
                         f"got {interval}")
    rate_text = values.get("request_rate") or "inf"
    try:
        rate = float(rate_text)
    except ValueError:
        raise UsageError(f"--compare vllm takes one --request-rate, got {rate_text!r}") from None
    from plugserve.bench.hf import hf_model_dir

    options = serving_vllm.VllmServingOptions(
        python=Path(python), model=Path(hf_model_dir(offline.get("model"))),
        dtype=offline.get("dtype") or "float32", num_seqs=values.get("num_seqs") or 64,
        input_len=values.get("input_len") or 128, output_len=values.get("output_len") or 128,
        request_rate=rate if rate > 0 else math.inf,
        backend="openai-chat" if values.get("dataset") == "chat" else "openai",
        stream_interval=interval or 1, seed=values.get("seed") or 0)
    try:
        report = serving_vllm.run(options, None if json_out else
                                  lambda name: typer.echo(f"bench serving: {name} ...", err=True))
    except (RuntimeError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if json_out:
        print_json(report)
    else:
        serving_vllm.print_report(report)
