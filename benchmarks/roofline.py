"""Batch-1 decode roofline: how close plugserve's decode step comes to the memory bandwidth.

At batch 1 a decode step has to read every weight once (a tied embedding in full, as the LM
head; an untied one only one row) and the KV cache of its context, so on a machine that reads
B bytes/s it cannot take less than bytes / B. This script measures

- B: the read bandwidth of this machine, `sum()` of a large float32 tensor (best of several),
  measured just before and just after each dtype's decode runs; the higher of the two is used
  (this machine's bandwidth moves with its neighbours' load, and the higher reading gives
  the stricter bound). For reference, a `copy_` (read + write) and one GEMV shaped like the
  LM head through the engine's own linear (`plugserve.model.layers.linear`) in each dtype;
- plugserve's batch-1 decode step on the default model (or --model), fp32 and bf16: one
  request of --prompt-len random tokens and --new-tokens output tokens, greedy, EOS ignored;
  the step time is TPOT, (latency - TTFT) / (new tokens - 1), best of --repeats; the forward
  alone is the engine's `forward` phase time over the decode steps;
- the bytes per step: the weights as the matmuls read them (in their own dtype: bf16 weights
  are read as bf16 by the CPU kernels on every ISA; a float32 copy only without the kernels,
  see core/model/layers.py) plus the KV of the mean context;

and prints the bandwidth bound, the measured step and their ratio (the fraction of the
roofline reached), and the ISA copy of the CPU kernels that ran (`PLUGSERVE_CPU_ISA=avx2`
forces the AVX2 one on an AVX-512 machine). Torch uses `torch.get_num_threads()` threads for
both (OMP_NUM_THREADS).

With --pairs N (default 5), N more decode runs, the bandwidth read just before the first
and after each; each run is held against the higher of the two readings next to it, and the
median of those fractions is printed with their range: on a host whose speed drifts (a
shared machine), the best TPOT and the best bandwidth of the main figure may come from
moments minutes apart, and a run compared with the bandwidth of its own moment is the
steadier figure.

With --split, one more run of the same request times each decode step's parts (the median
over its steps): the decoder layers (the compiled stack's one call), the LM head (`compute_logits`),
the rest of the model's `forward` (embedding, rope, attention plans, final norm: Python and
small ops) and the rest of the step outside `forward` (scheduling, batch tensors, sampling),
each with the GB/s its weight bytes make over its time: what is between the kernels and the
roofline. The timers wrap those calls for that run only.

    python benchmarks/roofline.py [--dtypes float32,bfloat16] [--prompt-len 128]
        [--new-tokens 128] [--repeats 3] [--bandwidth-mib 1024] [--model PATH] [--pairs 5]
        [--split] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from plugserve.bench.bandwidth import GB, best_seconds, measure_bandwidth, weight_bytes


def measure_gemv(rows: int, cols: int, dtype: torch.dtype, repeats: int) -> float:
    """GB/s of one x[1, cols] @ W[rows, cols].T through the engine's linear, the weight's
    bytes over the time."""
    from plugserve.model.layers import linear

    weight = torch.randn(rows, cols).to(dtype)
    x = torch.randn(1, cols).to(dtype)
    with torch.inference_mode():
        seconds = best_seconds(lambda: linear(x, weight, None), max(repeats, 20))
    return weight.numel() * weight.element_size() / seconds / GB


def kv_bytes_per_token(engine: Any) -> int:
    arch = engine.arch
    layers = len(engine.model.layers)
    elt = torch.empty((), dtype=engine.dtype).element_size()
    return int(layers * 2 * arch.num_key_value_heads * arch.head_dim * elt)


def generate_once(engine: Any, prompt: list[int], n: int) -> tuple[float, float, float]:
    """One greedy request of `n` tokens (EOS ignored): its TTFT, its latency and the engine's
    forward time during it, in seconds."""
    from plugserve.sampling import SamplingParams

    def forward_s() -> float:
        return float(engine.stats().get("step_time_s", {}).get("forward", 0.0))

    before = forward_s()
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert len(result.token_ids) == n, result
    return result.stats["ttft_s"], result.stats["latency_s"], forward_s() - before


def decode_step(engine: Any, prompt: list[int], new_tokens: int,
                repeats: int) -> dict[str, float]:
    def run(n: int) -> tuple[float, float, float]:
        return generate_once(engine, prompt, n)

    run(8)  # warm-up
    prefill_forward = min(run(1)[2] for _ in range(repeats))
    best_tpot = best_forward = float("inf")
    for _ in range(repeats):
        ttft, latency, forward = run(new_tokens)
        best_tpot = min(best_tpot, (latency - ttft) / (new_tokens - 1))
        best_forward = min(best_forward, (forward - prefill_forward) / (new_tokens - 1))
    return {"tpot_s": best_tpot, "forward_s": best_forward, "prefill_forward_s": prefill_forward}


def paired_fractions(engine: Any, prompt: list[int], new_tokens: int, runs: int,
                     step_bytes: float, mib: int) -> dict[str, Any]:
    """`runs` decode runs, the read bandwidth measured before the first and after each: run
    i's bound uses the higher of the two readings next to it (the stricter, as the main
    figure), so a host whose speed drifts between readings minutes apart is compared with
    itself at about the same moment. The median fraction of the roofline and its range."""
    readings = [measure_bandwidth(mib, 3)["read_gb_s"]]
    tpots: list[float] = []
    for _ in range(runs):
        ttft, latency, _ = generate_once(engine, prompt, new_tokens)
        tpots.append((latency - ttft) / (new_tokens - 1))
        readings.append(measure_bandwidth(mib, 3)["read_gb_s"])
    fractions = [step_bytes / (max(readings[i], readings[i + 1]) * GB) / tpot
                 for i, tpot in enumerate(tpots)]
    return {"runs": runs, "read_gb_s": readings, "tpot_s": tpots, "fractions": fractions,
            "median_fraction": statistics.median(fractions)}


@contextlib.contextmanager
def timed(owner: Any, name: str, record: Callable[[float, float], None]) -> Iterator[None]:
    """`owner.name` (a class's method) reporting (start, seconds) of every call to `record`
    while the block runs."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record(start, time.perf_counter() - start)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def step_split(engine: Any, prompt: list[int], new_tokens: int) -> dict[str, float] | None:
    """Median seconds per decode step of the decoder stack, the LM head, the rest of forward
    and the rest of the step (None where the decode steps do not run the compiled stack)."""
    from plugserve.kernels import decode_layer
    from plugserve.sampling import SamplingParams

    model_type = type(engine.model)
    # (name, start, seconds) as each call ends: a forward's stack and head calls come before it.
    calls: list[tuple[str, float, float]] = []

    def record(name: str) -> Callable[[float, float], None]:
        return lambda start, seconds: calls.append((name, start, seconds))

    with timed(decode_layer.DecodeStack, "run", record("stack")), \
            timed(model_type, "compute_logits", record("head")), \
            timed(model_type, "forward", record("forward")):
        engine.generate([prompt], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    # The decode steps: the forwards that ran the stack (the prefill's does not).
    steps: list[dict[str, float]] = []
    inside: dict[str, float] = {}
    for name, start, seconds in calls:
        if name != "forward":
            inside[name] = seconds
            continue
        if "stack" in inside:
            steps.append({"start": start, "forward": seconds, **inside})
        inside = {}
    if len(steps) < 2:
        return None
    step_s = statistics.median(b["start"] - a["start"] for a, b in itertools.pairwise(steps))
    stack_s = statistics.median(s["stack"] for s in steps)
    head_s = statistics.median(s["head"] for s in steps)
    forward_s = statistics.median(s["forward"] for s in steps)
    return {"step_s": step_s, "stack_s": stack_s, "lm_head_s": head_s,
            "forward_rest_s": forward_s - stack_s - head_s, "outside_forward_s": step_s - forward_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-mib", type=int, default=1024)
    parser.add_argument("--model", default=None)
    parser.add_argument("--pairs", type=int, default=5,
                        help="decode runs each next to its own bandwidth readings (0: none)")
    parser.add_argument("--split", action="store_true",
                        help="time each decode step's parts in one more run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")

    from plugserve.engine import Engine
    from plugserve.kernels import build

    threads = torch.get_num_threads()
    bandwidth_repeats = max(args.repeats, 5)
    rng = random.Random(0)
    library = build.library()
    isa = library.isa() if library is not None else f"none ({build.unavailable_reason()})"
    out: dict[str, Any] = {"threads": threads, "kernel_isa": isa, "runs": []}
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        with Engine(model=args.model, dtype=dtype) as engine:
            before = measure_bandwidth(args.bandwidth_mib, bandwidth_repeats)
            vocab = int(engine.arch.vocab_size)
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            weights, upcast = weight_bytes(engine.model)
            kv_token = kv_bytes_per_token(engine)
            mean_context = args.prompt_len + (args.new_tokens - 1) / 2
            step_bytes = weights + kv_token * mean_context
            step = decode_step(engine, prompt, args.new_tokens, args.repeats)
            split = step_split(engine, prompt, args.new_tokens) if args.split else None
            paired = (paired_fractions(engine, prompt, args.new_tokens, args.pairs, step_bytes,
                                       args.bandwidth_mib) if args.pairs > 0 else None)
            head_bytes = engine.model.lm_head_holder.resident_bytes()
            after = measure_bandwidth(args.bandwidth_mib, bandwidth_repeats)
            bandwidth = max(before, after, key=lambda b: b["read_gb_s"])
            hidden = int(engine.arch.hidden_size)
            gemv = measure_gemv(vocab, hidden, engine.dtype, args.repeats)
        bound = step_bytes / (bandwidth["read_gb_s"] * GB)
        out["runs"].append({
            "dtype": dtype,
            "bandwidth": bandwidth,
            "read_gb_s_before_after": [before["read_gb_s"], after["read_gb_s"]],
            "matmul_upcast_to_fp32": upcast,
            "weight_bytes": weights,
            "kv_bytes_per_token": kv_token,
            "mean_context": mean_context,
            "bytes_per_step": step_bytes,
            "bound_s": bound,
            **step,
            "tok_s": 1 / step["tpot_s"],
            "bound_tok_s": 1 / bound,
            "fraction_of_roofline": bound / step["tpot_s"],
            "forward_fraction_of_roofline": bound / step["forward_s"],
            "lm_head_gemv_gb_s": gemv,
            "split": split,
            "paired": paired,
            "lm_head_bytes": head_bytes,
        })
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"threads {threads}; CPU kernels: {isa}; read bandwidth: sum of {args.bandwidth_mib} MiB fp32, before and "
          "after each dtype's runs, the higher used")
    for r in out["runs"]:
        bw = r["bandwidth"]
        first, second = r["read_gb_s_before_after"]
        print(
            f"{r['dtype']}: read bandwidth {bw['read_gb_s']:.1f} GB/s ({first:.1f} before, "
            f"{second:.1f} after; copy {bw['copy_gb_s']:.1f} GB/s read + write); "
            f"{r['bytes_per_step'] / 1e6:.1f} MB/step (weights "
            f"{r['weight_bytes'] / 1e6:.1f} MB{' as fp32 copies' if r['matmul_upcast_to_fp32'] else ''}"
            f", KV {r['kv_bytes_per_token'] * r['mean_context'] / 1e6:.1f} MB at mean context "
            f"{r['mean_context']:.0f}); bound {r['bound_s'] * 1e3:.2f} ms = "
            f"{r['bound_tok_s']:.1f} tok/s; measured TPOT {r['tpot_s'] * 1e3:.2f} ms = "
            f"{r['tok_s']:.1f} tok/s -> {r['fraction_of_roofline']:.1%} of the roofline "
            f"(forward alone {r['forward_s'] * 1e3:.2f} ms, "
            f"{r['forward_fraction_of_roofline']:.1%}); LM-head GEMV alone "
            f"{r['lm_head_gemv_gb_s']:.1f} GB/s"
        )
        paired = r["paired"]
        if paired is not None:
            fractions, readings = paired["fractions"], paired["read_gb_s"]
            print(f"  paired ({paired['runs']} runs, the bandwidth read before and after each, "
                  f"{min(readings):.1f}-{max(readings):.1f} GB/s): median "
                  f"{paired['median_fraction']:.1%} of the roofline (runs "
                  f"{min(fractions):.1%}-{max(fractions):.1%})")
        split = r["split"]
        if split is not None:
            layer_bytes = r["weight_bytes"] - r["lm_head_bytes"]
            print(
                f"  a decode step's parts (median ms): step {split['step_s'] * 1e3:.2f} = decoder "
                f"layers {split['stack_s'] * 1e3:.2f} ({layer_bytes / split['stack_s'] / GB:.1f} "
                f"GB/s over their {layer_bytes / 1e6:.1f} MB of weights; the KV besides) + LM head "
                f"{split['lm_head_s'] * 1e3:.2f} ({r['lm_head_bytes'] / split['lm_head_s'] / GB:.1f}"
                f" GB/s over {r['lm_head_bytes'] / 1e6:.1f} MB) + the rest of forward "
                f"{split['forward_rest_s'] * 1e3:.2f} + outside forward "
                f"{split['outside_forward_s'] * 1e3:.2f}"
            )
        elif args.split:
            print("  (--split: the decode steps did not run the compiled decoder stack)")


if __name__ == "__main__":
    main()
