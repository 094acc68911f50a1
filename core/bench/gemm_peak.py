"""A workload's share of the machine's GEMM peak, in the dtype it runs.

Peak: the engine's own `Linear` modules of the first decoder layer (qkv, o, gate-up, down:
the decoder's shapes, the model's dtype, the kernels the engine uses) called on `ROWS` rows,
each timed best of `REPEATS`; the peak is the best rows' total FLOPs over their total time.
It is measured in the same run as the workload, just before it and just after it, and the
higher of the two readings is used: the machine's speed moves with its neighbours' load, a
single reading taken in a slow moment would flatter the workload's share (one such reading
put a run at 76% "of the peak" while the runs just before and after it read 52-55%), and the
higher gives the stricter figure.

Workload FLOPs (multiply-adds count 2): every decoder-layer linear for every token the
decoder computes (each prompt token, and each output token but the last, which is sampled and
never fed back), the LM head for every sampled token, and attention's QK and PV products
(4 x heads x head_dim per key read: a token at position p reads p + 1 keys, or the window).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plugserve.model.layers import Linear

ROWS = (64, 512, 2048)  # decode batch, prefill chunks
REPEATS = 3
MIN_TIMED_S = 0.05  # each timing repeats the call until this much time has passed


@dataclass(frozen=True)
class WorkloadFlops:
    linear: float
    lm_head: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.lm_head + self.attention


def _linears(module: torch.nn.Module) -> list[Linear]:
    from plugserve.model.layers import Linear

    return [m for m in module.modules() if isinstance(m, Linear)]


def _linear_flops_per_row(module: torch.nn.Module) -> float:
    return float(sum(2 * m.weight.shape[0] * m.weight.shape[1] for m in _linears(module)))


def workload_flops(model: Any, arch: Any, prompt_lens: list[int],
                   output_lens: list[int]) -> WorkloadFlops:
    """FLOPs of generating `output_lens[i]` tokens after prompt `i` (module docstring)."""
    layers = list(model.decoder_layers)
    per_token = sum(_linear_flops_per_row(layer) for layer in layers)
    computed = sum(p + n - 1 for p, n in zip(prompt_lens, output_lens, strict=True))
    sampled = sum(output_lens)
    lm_head = 2.0 * arch.vocab_size * arch.hidden_size * sampled
    key_cost = 4.0 * arch.num_attention_heads * arch.head_dim  # QK and PV per key, per layer
    attention = 0.0
    for window in arch.layer_sliding_window:
        for p, n in zip(prompt_lens, output_lens, strict=True):
            attention += key_cost * _keys_read(p + n - 1, window)
    return WorkloadFlops(per_token * computed, lm_head, attention)


def _keys_read(tokens: int, window: int | None) -> int:
    """Keys read by `tokens` consecutive tokens from position 0 (position j reads j + 1, or
    at most `window`)."""
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def _time(call: Any, device: torch.device) -> float:
    """Seconds per call: the best of REPEATS runs, each repeating `call` for MIN_TIMED_S."""
    best = float("inf")
    for _ in range(REPEATS):
        calls, start = 0, time.perf_counter()
        while True:
            call()
            calls += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= MIN_TIMED_S or calls >= 1000:
                break
        best = min(best, elapsed / calls)
    return best


def measure_peak(model: Any, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """FLOP/s of the first decoder layer's linears at each of `ROWS` (best = the peak)."""
    linears = _linears(model.decoder_layers[0])
    by_rows: dict[int, float] = {}
    with torch.inference_mode():
        for rows in ROWS:
            flops, seconds = 0.0, 0.0
            for linear in linears:
                x = torch.randn(rows, linear.weight.shape[1], device=device).to(dtype)
                linear(x)  # warm: packing, first-call allocations
                seconds += _time(lambda linear=linear, x=x: linear(x), device)
                flops += 2.0 * rows * linear.weight.shape[0] * linear.weight.shape[1]
            by_rows[rows] = flops / seconds
    best = max(by_rows, key=lambda r: by_rows[r])
    return {"flop_per_s": by_rows[best], "rows": best,
            "by_rows": {str(r): f for r, f in by_rows.items()}}


def gemm_share(engine: Any, prompt_lens: list[int], output_lens: list[int],
               seconds: float, peak_before: dict[str, Any] | None = None) -> dict[str, Any]:
    """The workload's FLOPs, FLOP/s over `seconds`, the peak and the fraction. The peak is
    measured now (after the workload); with `peak_before` (`measure_peak` just before the
    workload ran) the higher of the two readings is the one used."""
    flops = workload_flops(engine.model, engine.arch, prompt_lens, output_lens)
    after = measure_peak(engine.model, engine.dtype, engine.device)
    readings = [after] if peak_before is None else [peak_before, after]
    peak = max(readings, key=lambda r: float(r["flop_per_s"]))
    achieved = flops.total / seconds if seconds > 0 else 0.0
    return {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "flops": flops.total, "linear_flops": flops.linear, "lm_head_flops": flops.lm_head,
        "attention_flops": flops.attention, "seconds": seconds, "flop_per_s": achieved,
        "peak_flop_per_s": peak["flop_per_s"], "peak_rows": peak["rows"],
        "peak_by_rows": peak["by_rows"],
        "peak_readings_flop_per_s": [r["flop_per_s"] for r in readings],
        "fraction": achieved / peak["flop_per_s"] if peak["flop_per_s"] > 0 else None,
    }
