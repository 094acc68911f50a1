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
