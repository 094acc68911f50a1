"""Tables of a `bench serving` report: throughput, latency (TTFT, ITL, TPOT, E2E), goodput."""

from __future__ import annotations

from typing import Any

from plugserve.bench.report import _ms, _num, _say, throughput_table


def print_serving_report(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    work = report["workload"]
    source = (f"random {work['input_len']}-token prompts" if work["dataset"] == "random"
              else "chat prompts")
    title = (f"serving {work['model']} at {work['base_url']} ({work['num_seqs']} requests per "
             f"rate, {source}, {work['output_len']} output tokens, EOS ignored)")
    console.print(throughput_table(report, title))
    table = Table("run", "TTFT mean", "median", "p99", "ITL mean", "median", "p99",
                  "TPOT mean", "median", "p99", "E2E mean", "p99",
                  title="latency (ms; ITL is 0 between tokens of one chunk)")
    for run in report["runs"]:
        t, i, p, e = run["ttft_s"], run["itl_s"], run["tpot_s"], run["e2el_s"]
        table.add_row(run["name"], _ms(t["mean"]), _ms(t["median"]), _ms(t["p99"]),
                      _ms(i["mean"]), _ms(i["median"]), _ms(i["p99"]), _ms(p["mean"]),
                      _ms(p["median"]), _ms(p["p99"]), _ms(e["mean"]), _ms(e["p99"]))
    console.print(table)
    limits = work.get("goodput_ms") or {}
    for run in report["runs"]:
        line = f"{run['name']}: {run['requests']} served, {run['failed']} failed"
        if limits:
            shown = ", ".join(f"{k} <= {v:g} ms" for k, v in limits.items())
            line += f"; goodput ({shown}) {_num(run['goodput_req_per_s'], 2)} req/s"
        _say(console, line)
        for message, count in run["errors"].items():
            _say(console, f"  {count} x {message}")
