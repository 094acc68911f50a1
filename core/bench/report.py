"""Render a `plugserve bench` report (the JSON document) as rich tables on stdout."""

from __future__ import annotations

import sys
from typing import Any

TITLES = {
    "throughput": "offline throughput ({num_seqs} seqs, greedy, EOS ignored)",
    "shared-prefix": "shared prefix ({groups} groups x {prompts_per_group} prompts, prefix "
    "{prefix_len} + question {question_len} tokens, {output_len} out)",
    "latency": "latency (batch {batch_size}, {input_len} prompt + {output_len} output tokens; "
    "the median of {num_iters} iterations)",
    "spec": "speculative decoding ({prompts} chat prompts, {output_len} tokens each)",
}


def print_report(report: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    work = report["workload"]
    name = work.get("name", "throughput")
    if name == "serving":  # measured over HTTP: no engine step times
        from plugserve.bench.serving_report import print_serving_report

        print_serving_report(report, console)
        return
    title = TITLES.get(name, name).format(**work)
    console.print(throughput_table(report, title))
    console.print(latency_table(report))
    console.print(step_table(report))
    extra = {"shared-prefix": shared_prefix_lines, "spec": spec_lines}.get(name)
    if extra is not None:
        extra(report, console)
    if name != "spec" and any(run.get("accept_len") is not None for run in report["runs"]):
        for run in report["runs"]:
            _say(console, f"{run['name']}: acceptance length {_num(run['accept_len'], 2)}, "
                          f"target forwards / token {_num(run['target_forwards_per_token'], 3)}")
    for run in report["runs"]:
        mask = run.get("grammar_mask")
        if mask is not None:
            _say(console, f"{run['name']}: grammar mask {mask['mask_ms_per_step']:.3f} ms per "
                          f"step of {mask['step_ms']:.2f} ms ({_share(mask['share_of_step'])} "
                          f"of the step, {mask['steps']} steps)")
    if name in ("throughput", "prefill") and "prompt_tokens" in work:
        _say(console, f"workload tokens: {work['prompt_tokens']:,} prompt, "
                      f"{work['output_tokens']:,} output")
    iterations = [(run["name"], run["iteration_seconds"]) for run in report["runs"]
                  if run.get("iteration_seconds")]
    if report.get("vllm") and report["vllm"].get("iteration_seconds") and iterations:
        iterations.append(("vLLM", report["vllm"]["iteration_seconds"]))
    if iterations:
        _say(console, "each run is the median of its timings (s): " + "; ".join(
            f"{label} {', '.join(f'{t:.3f}' for t in times)}" for label, times in iterations))
    if report.get("gemm") is not None:
        gemm_line(report["gemm"], console)
    hf = report.get("transformers")
    if hf is not None:
        ratios = ", ".join(
            f"{r['name']} {_ratio(r.get('vs_transformers'))}" for r in report["runs"]
        )
        _say(console, f"plugserve / transformers (output tok/s): {ratios}")
    if report.get("vllm") is not None:
        vllm_lines(report, console)


def _say(console: Any, text: str) -> None:
    """A plain line: no rich highlighting of the numbers in it."""
    console.print(text, highlight=False)


def _num(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def _ms(value: Any) -> str:
    return _num(value, 2, 1000.0)


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def throughput_table(report: dict[str, Any], title: str) -> Any:
    from rich.table import Table

    hf = report.get("transformers")
    vllm = report.get("vllm")
    table = Table("run", "reqs", "prompt tok", "output tok", "seconds", "req/s", "input tok/s",
                  "output tok/s", title=title)
    if hf is not None:
        table.add_column("vs HF")
    if vllm is not None:
        table.add_column("vs vLLM")
    for run in report["runs"]:
        row = [
            run["name"],
            str(run["requests"]),
            f"{run['prompt_tokens']:,}",
            f"{run['output_tokens']:,}",
            _num(run["seconds"], 2),
            _num(run["request_per_s"], 2),
            _num(run["input_tok_per_s"]),
            _num(run["output_tok_per_s"]),
        ]
        if hf is not None:
            row.append(_ratio(run.get("vs_transformers")))
        if vllm is not None:
            row.append(_ratio(run.get("vs_vllm")))
        table.add_row(*row)
    if hf is not None:
        seconds = hf["seconds"]
        row = [
            f"transformers (batch {hf['batch_size']})",
            str(hf.get("requests", "-")),
            f"{hf['prompt_tokens']:,}",
            f"{hf['output_tokens']:,}",
            _num(seconds, 2),
            _num(hf["requests"] / seconds if "requests" in hf and seconds else None, 2),
            _num(hf["prompt_tokens"] / seconds if seconds else None),
            _num(hf["output_tok_per_s"]),
            "1.00x",
        ]
        if vllm is not None:
            row.append(_ratio(_over(hf["output_tok_per_s"], vllm.get("output_tok_per_s"))))
        table.add_row(*row)
    if vllm is not None:
        seconds = vllm.get("seconds")
        row = [
            f"vLLM {vllm.get('vllm_version', '')} (CPU)".replace("  ", " "),
            str(vllm.get("requests", "-")),
            f"{vllm.get('prompt_tokens', 0):,}",
            f"{vllm.get('output_tokens', 0):,}",
            _num(seconds, 2),
            _num(_over(vllm.get("requests"), seconds), 2),
            _num(_over(vllm.get("prompt_tokens"), seconds)),
            _num(vllm.get("output_tok_per_s")),
        ]
        if hf is not None:
            row.append(_ratio(_over(vllm.get("output_tok_per_s"), hf["output_tok_per_s"])))
        row.append("1.00x")
        table.add_row(*row)
    return table


def _over(a: Any, b: Any) -> float | None:
    return a / b if a is not None and b else None


def vllm_lines(report: dict[str, Any], console: Any) -> None:
    vllm = report["vllm"]
    runs = report["runs"]
    ratios = ", ".join(f"{r['name']} {_ratio(r.get('vs_vllm'))}" for r in runs)
    _say(console, f"plugserve / vLLM (output tok/s): {ratios}")
    agreeing = []
    first = None
    for run in runs:
        agree = run.get("vllm_agreement")
        if agree is None:
            continue
        first, fraction = agree["first_tokens"], agree["fraction"]
        agreeing.append(
            f"{run['name']} {'-' if fraction is None else f'{fraction:.1%}'} (common prefix "
            f"{_num(agree['common_prefix_mean'])} tokens, {agree['requests_identical']} of "
            f"{agree['requests']} requests identical)"
        )
    if agreeing:
        _say(console, f"first {first} greedy tokens equal to vLLM's: {'; '.join(agreeing)}")
    _say(console, f"vLLM: prefill of all {vllm.get('requests', '-')} prompts (1 output token) "
                  f"{_num(vllm.get('prefill_seconds'), 2)} s; start-up (load, "
                  f"compile) {_num(vllm.get('load_seconds'))} s; {vllm.get('dtype', '')}, "
                  f"{vllm.get('python', '')}")


def latency_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table("run", "TTFT mean", "median", "p99", "ITL mean", "median", "p95", "p99",
                  "TPOT mean", title="latency (ms; ITL is 0 between tokens of one spec round)")
    for run in report["runs"]:
        ttft, itl = run["ttft_s"], run["itl_s"]
        table.add_row(
            run["name"], _ms(ttft["mean"]), _ms(ttft["median"]), _ms(ttft["p99"]),
            _ms(itl["mean"]), _ms(itl["median"]), _ms(itl["p95"]), _ms(itl["p99"]),
            _ms(run["tpot_s"]["mean"]),
        )
    return table


def step_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    names: list[str] = []
    for run in report["runs"]:
        names += [g for g in run["step_time"]["groups"] if g not in names]
    table = Table("run", *(SHORT.get(n, n) for n in names), "total s",
                  title="step time (seconds, share of the total)")
    for run in report["runs"]:
        groups = run["step_time"]["groups"]
        cells = []
        for g in names:
            part = groups.get(g)
            cells.append("-" if part is None else
                         f"{part['seconds']:.3f} {_share(part['fraction'])}")
        table.add_row(run["name"], *cells, f"{run['step_time']['total_s']:.3f}")
    return table


SHORT = {"schedule": "sched", "metadata": "meta", "post_process": "post",
         "draft_extend": "draft ext"}


def _share(fraction: float | None) -> str:
    return "" if fraction is None else f"{fraction:.0%}"


def shared_prefix_lines(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    summary = report["summary"]
    unique = summary["prompt_tokens_unique"]
    table = Table("run", "prompt tok", "unique", "prefill computed", "computed / unique",
                  "TTFT mean ms", title="prefix reuse")
    for run in report["runs"]:
        table.add_row(
            run["name"], f"{summary['prompt_tokens_total']:,}", f"{unique:,}",
            f"{run['prefill_tokens_computed']:,}", _ratio(run["computed_over_unique"]),
            _ms(run["ttft_s"]["mean"]),
        )
    console.print(table)
    targets = summary["targets"]
    _say(
        console,
        f"TTFT with cache / without: {_ratio(summary['ttft_ratio'])} (target <= 0.30: "
        f"{_ok(targets['ttft_ratio_le_0.3'])}); computed <= 1.1x unique: "
        f"{_ok(targets['computed_le_1.1x_unique'])}",
    )


def spec_lines(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table("method", "page", "batch", "accept len", "target fwd / tok", "output tok/s",
                  "vs plain", "lossless",
                  title="speculation (accept len = tokens per verify round; target fwd / tok "
                  "= (1 prefill + verify rounds) / output tokens)")
    for run in report["runs"]:
        s = run["settings"]
        table.add_row(
            s["method"], str(s["page_size"]), str(s["batch_size"]), _num(run["accept_len"], 2),
            _num(run["target_forwards_per_token"], 3), _num(run["output_tok_per_s"]),
            _ratio(run["speedup_vs_plain"]), _ok(run["lossless"]),
        )
    console.print(table)
    summary = report["summary"]
    speedups = ", ".join(f"{k} {_ratio(v)}" for k, v in summary["batch1_speedup_vs_plain"].items())
    _say(console, f"batch 1, spec / plain output tok/s: {speedups}")
    _say(console, f"lossless (spec tokens == plain tokens): {_ok(summary['lossless'])}")


def _ok(flag: bool) -> str:
    return "yes" if flag else "NO"


def gemm_line(gemm: dict[str, Any], console: Any) -> None:
    """The workload's FLOP/s against the GEMM peak measured in the same run."""
    readings = gemm.get("peak_readings_flop_per_s") or []
    when = (" (before / after the run "
            + " / ".join(f"{r / 1e9:,.1f}" for r in readings) + ", the higher used)"
            if len(readings) > 1 else "")
    _say(console, f"GEMM peak share ({gemm['dtype']}): {gemm['flops'] / 1e9:,.1f} GFLOP "
                  f"(linears {gemm['linear_flops'] / 1e9:,.1f}, LM head "
                  f"{gemm['lm_head_flops'] / 1e9:,.1f}, attention "
                  f"{gemm['attention_flops'] / 1e9:,.1f}) in {gemm['seconds']:.2f} s = "
                  f"{gemm['flop_per_s'] / 1e9:,.1f} GFLOP/s; the engine's linear at the "
                  f"decoder's shapes peaks at {gemm['peak_flop_per_s'] / 1e9:,.1f} GFLOP/s "
                  f"({gemm['peak_rows']} rows){when} -> {gemm['fraction'] or 0:.1%} of the "
                  "peak")
