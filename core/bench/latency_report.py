"""Render `plugserve bench latency`'s summary: plugserve beside llama.cpp, the roofline, the
first greedy tokens of each side."""

from __future__ import annotations

import sys
from typing import Any


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def latency_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    mine, theirs = report["latency"]["plugserve"], report.get("llamacpp")
    roofline = report["roofline"]
    table = Table("", "plugserve")
    if theirs is not None:
        table.add_column(f"llama.cpp {theirs.get('llama_cpp_version', '')} (batch 1)")
        table.add_column("plugserve / llama.cpp")
    ratios = report.get("vs_llamacpp", {})
    rows = [
        ("batch size", str(mine["batch_size"]), "1", None),
        ("mean latency s", _num(mine["avg_latency_s"], 3),
         _num(_mean(theirs.get("latency_s")) if theirs else None, 3), None),
        ("decode tok/s (median)", _num(mine["decode_tok_per_s"]),
         _num(theirs.get("decode_tok_per_s") if theirs else None),
         _ratio(ratios.get("decode"))),
        ("prefill tok/s (median)", _num(mine["prefill_tok_per_s"]),
         _num(theirs.get("prefill_tok_per_s") if theirs else None),
         _ratio(ratios.get("prefill"))),
        ("share of the roofline", _pct(roofline.get("plugserve")),
         _pct(roofline.get("llamacpp")), None),
    ]
    for label, engine, other, ratio in rows:
        cells = [label, engine]
        if theirs is not None:
            cells += [other, ratio or ""]
        table.add_row(*cells)
    return table


def print_latency(report: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    say = lambda text: console.print(text, highlight=False)  # noqa: E731
    work = report["workload"]
    say(f"latency: batch {work['batch_size']}, {work['input_len']} prompt + "
        f"{work['output_len']} output tokens, greedy, EOS ignored; {work['num_iters']} timed "
        f"iterations after {work['num_iters_warmup']}; {work['threads']} threads")
    console.print(latency_table(report))
    mine = report["latency"]["plugserve"]
    pcts = ", ".join(f"{k} {_num(v, 3)}" for k, v in mine["percentiles_s"].items())
    say(f"plugserve latency percentiles (s): {pcts}")
    roofline, bandwidth = report["roofline"], report["bandwidth"]
    readings = ", ".join(_num(r) for r in bandwidth["read_gb_s_readings"])
    types = roofline.get("tensor_types")
    kinds = f" ({', '.join(f'{n} {t}' for t, n in types.items())})" if types else ""
    bound = roofline.get("bound_steps_per_s")
    say(f"roofline: {roofline['bytes_per_token'] / 1e6:.1f} MB per decode step from the "
        f"{roofline['source']}{kinds} at {_num(bandwidth['read_gb_s'])} GB/s read bandwidth "
        f"(highest of {readings}) -> {_num(bound)} steps/s")
    engine_bytes = roofline.get("engine_weight_bytes_per_token")
    if engine_bytes:
        say(f"plugserve's loaded weights: {engine_bytes / 1e6:.1f} MB read per decode step")
    theirs = report.get("llamacpp")
    if theirs is None:
        return
    if int(mine["batch_size"]) > 1:
        say(f"llama.cpp ran batch 1; plugserve batch {mine['batch_size']} (decode tok/s over "
            "all sequences)")
    agree = report["agreement"]
    say(f"first {agree['first_tokens']} greedy tokens (plugserve request 0 / llama.cpp): "
        f"{agree['agree']} of {agree['compared']} equal, common prefix "
        f"{_num(agree['common_prefix_mean'], 0)}")
    say(f"  plugserve: {mine['first_tokens']}")
    say(f"  llama.cpp: {theirs['first_tokens']}")
    info = str(theirs.get("system_info", ""))
    if info:
        say(f"llama.cpp system info: {info}")


def _mean(values: Any) -> float | None:
    return sum(values) / len(values) if values else None
