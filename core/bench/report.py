"""Render a `plugserve bench` report as a rich table."""

from __future__ import annotations

from typing import Any


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    work = report["workload"]
    table = Table(
        "implementation",
        "seqs",
        "prompt tok",
        "output tok",
        "seconds",
        "output tok/s",
        title=f"offline throughput ({work['num_seqs']} seqs, greedy, EOS ignored)",
    )
    rows = [("plugserve", report["engine"])]
    if "transformers" in report:
        hf = report["transformers"]
        rows.append((f"transformers (batch {hf['batch_size']})", hf))
    for name, run in rows:
        table.add_row(
            name,
            str(work["num_seqs"]),
            f"{run['prompt_tokens']:,}",
            f"{run['output_tokens']:,}",
            f"{run['seconds']:.2f}",
            f"{run['output_tok_per_s']:.1f}",
        )
    console = Console()
    console.print(table)
    if report.get("speedup") is not None:
        console.print(f"plugserve / transformers: {report['speedup']:.2f}x")
