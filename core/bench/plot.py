"""`--plot FILE.png`: a bar chart of a report's main figures (matplotlib, Agg backend).

throughput, prefill: output tok/s per run (and transformers, vLLM). shared-prefix: output tok/s, mean TTFT
and prefill tokens computed per cache setting (with the total and unique prompt tokens).
spec: output tok/s and acceptance length per configuration. serving: output tok/s, mean TTFT,
mean TPOT (and goodput) per request rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Panel:
    title: str
    labels: list[str]
    values: list[float]
    fmt: str = "%.1f"  # bar label format


def panels(report: dict[str, Any]) -> list[Panel]:
    """The bar groups to draw for this report's workload."""
    runs = report["runs"]
    names = [r["name"] for r in runs]
    rates = [float(r["output_tok_per_s"] or 0.0) for r in runs]
    hf = report.get("transformers")
    if hf is not None:
        names.append(f"transformers (batch {hf['batch_size']})")
        rates.append(float(hf["output_tok_per_s"]))
    vllm = report.get("vllm")
    if vllm is not None and vllm.get("output_tok_per_s"):
        names.append(f"vLLM {vllm.get('vllm_version', '')} (CPU)".replace("  ", " "))
        rates.append(float(vllm["output_tok_per_s"]))
    out = [Panel("output tok/s", names, rates)]
    kind = report["workload"].get("name", "throughput")
    if kind == "shared-prefix":
        summary = report["summary"]
        out.append(Panel("TTFT mean (ms)", [r["name"] for r in runs],
                         [float(r["ttft_s"]["mean"] or 0.0) * 1000 for r in runs]))
        out.append(Panel(
            "prompt tokens",
            ["total", "unique", *(f"computed, {r['name']}" for r in runs)],
            [float(summary["prompt_tokens_total"]), float(summary["prompt_tokens_unique"]),
             *(float(r["prefill_tokens_computed"]) for r in runs)],
            fmt="%d",
        ))
    elif kind == "serving":
        out.append(Panel("TTFT mean (ms)", names,
                         [float(r["ttft_s"]["mean"] or 0.0) * 1000 for r in runs]))
        out.append(Panel("TPOT mean (ms)", names,
                         [float(r["tpot_s"]["mean"] or 0.0) * 1000 for r in runs]))
        if any(r.get("goodput_req_per_s") is not None for r in runs):
            out.append(Panel("goodput (req/s within the limits)", names,
                             [float(r["goodput_req_per_s"] or 0.0) for r in runs], fmt="%.2f"))
    elif kind == "spec":
        spec = [r for r in runs if r["accept_len"] is not None]
        out.append(Panel("acceptance length (tokens / verify round)", [r["name"] for r in spec],
                         [float(r["accept_len"]) for r in spec], fmt="%.2f"))
    return out


def write_plot(report: dict[str, Any], path: str | Path) -> Path:
    """Draw the report's panels into a PNG (no pyplot: nothing global changes)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None

    groups = panels(report)
    height = sum(1.0 + 0.3 * len(p.labels) for p in groups)
    fig = Figure(figsize=(9, max(3.0, height)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), 1, squeeze=False)
    for ax, panel in zip(axes[:, 0], groups, strict=True):
        positions = list(range(len(panel.labels)))
        bars = ax.barh(positions, panel.values, color="tab:blue")
        ax.set_yticks(positions, panel.labels)
        ax.invert_yaxis()
        ax.set_title(panel.title)
        ax.bar_label(bars, fmt=panel.fmt, padding=3, fontsize=8)
        ax.margins(x=0.15)
    fig.suptitle(f"plugserve bench {report['workload'].get('name', 'throughput')}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100, format="png")
    return out
