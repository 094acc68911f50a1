"""Tensor parallelism on the CPU, side by side in one run.

1. Workload W (`plugserve bench`, throughput default: 64 prompts, 9,536 prompt / 8,224 output
   tokens, greedy, EOS ignored): TP=2 with one thread per rank against TP=1 with one thread
   and TP=1 with two threads, each a `plugserve bench --json` process, rounds interleaved.
2. Memory per rank: parameter bytes each rank holds, and each process's resident memory.
3. Batch-1 decode: time per output token at TP=2 (one thread per rank) and TP=1 (one thread).
4. Where a TP=2 step's time goes: torch.profiler on rank 0 over decode steps at batch 64 and
   at batch 1 (the collectives' share includes waiting for the other rank).

SmolLM2-135M has 9 query and 3 KV heads, which two ranks cannot split (plugserve refuses it,
as vLLM does). The runs use its shape with the heads re-cut to 8 query and 4 KV heads of 64
(the same attention parameter count), random weights and SmolLM2's tokenizer.

    flock /tmp/plugserve-bench.lock python benchmarks/tp_scaling.py [--rounds 2] [--json F]

Each part can be run alone (`--parts w,memory,decode,profile`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODEL_NAME = "smollm2-135m-shape-8q-4kv"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def bench_model(root: Path) -> Path:
    """SmolLM2-135M's shape with 8 query / 4 KV heads, random weights (made once)."""
    folder = root / MODEL_NAME
    if (folder / "model.safetensors").is_file():
        return folder
    import transformers

    from plugserve.model.default_model import default_model_path

    source = default_model_path()
    config = json.loads((source / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    for key in ("architectures", "torch_dtype", "model_type"):
        config.pop(key, None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float()
    staging = root / f".{MODEL_NAME}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)
    staging.rename(folder)
    return folder


def _run(args: list[str], threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


# --- 1. workload W --------------------------------------------------------------------------
W_CONFIGS = [("TP=1, 1 thread", 1, 1), ("TP=2, 1 thread per rank", 2, 1),
             ("TP=1, 2 threads", 1, 2)]


def part_w(model: Path, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {label: [] for label, _, _ in W_CONFIGS}
    for r in range(rounds):
        for label, tp, threads in W_CONFIGS:
            args = ["-m", "plugserve", "bench", "throughput", "--model", str(model), "--json"]
            if tp > 1:
                args += ["--tp", str(tp)]
            report = _run(args, threads)
            tok_s = float(report["runs"][0]["output_tok_per_s"])
            runs[label].append(tok_s)
            print(f"  W round {r + 1}: {label}: {tok_s:.1f} out tok/s", flush=True)
    best = {label: max(v) for label, v in runs.items()}
    tp2 = best["TP=2, 1 thread per rank"]
    return {"out_tok_per_s": runs, "best": best,
            "tp2_vs_tp1_1thread": tp2 / best["TP=1, 1 thread"],
            "tp2_vs_tp1_2threads": tp2 / best["TP=1, 2 threads"],
            "per_round_tp2_vs_tp1_1thread": [a / b for a, b in zip(
                runs["TP=2, 1 thread per rank"], runs["TP=1, 1 thread"], strict=True)],
            "per_round_tp2_vs_tp1_2threads": [a / b for a, b in zip(
                runs["TP=2, 1 thread per rank"], runs["TP=1, 2 threads"], strict=True)]}


# --- probes, each in a process of its own ----------------------------------------------------
def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _param_bytes(model: torch.nn.Module) -> int:
    from plugserve.model.weight_bytes import weight_bytes

    return weight_bytes(model)  # quantized weights as their blocks


def probe_memory(model: Path, tp: int) -> dict[str, Any]:
    from plugserve.engine import Engine
    from plugserve.model import ModelShard
    from plugserve.model.tp_layers import TPCausalLM
    from plugserve.sampling import SamplingParams

    with Engine(model=str(model), tp_size=tp) as engine:
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4))
        weights = [_param_bytes(engine.model)]
        for rank in range(1, tp):  # the same shapes as the rank's own model, on meta
            shard = ModelShard(rank, tp, engine.arch)
            weights.append(_param_bytes(TPCausalLM(engine.arch, shard, device="meta")))
        pids = [os.getpid()] + ([p.pid for p in engine.tp.children.processes] if engine.tp
                                else [])
        kv_bytes = sum(b.numel() * b.element_size() for pool in [engine.kv_pool]
                       for b in [*pool.k_buffer.values(), *pool.v_buffer.values()])
        return {"weights_bytes": weights, "rss_bytes": [_rss_bytes(p) for p in pids],
                "kv_pool_bytes_per_rank": kv_bytes,
                "kv_pool_tokens": engine.kv.allocator.total_slots}


def probe_decode(model: Path, tp: int, new_tokens: int) -> dict[str, Any]:
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams

    prompt = [(7 * i) % 10000 + 3 for i in range(32)]
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(model=str(model), tp_size=tp) as engine:
        engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
        tpots = []
        comm0 = engine.stats().get("tensor_parallel", {}).get("collectives_s", 0.0)
        t0 = time.perf_counter()
        for _ in range(3):
            (result,) = engine.generate([prompt], sp)
            stats = result.stats
            tpots.append((stats["latency_s"] - stats["ttft_s"]) / (new_tokens - 1))
        seconds = time.perf_counter() - t0
        comm = engine.stats().get("tensor_parallel", {}).get("collectives_s", 0.0) - comm0
    return {"tpot_s": tpots, "median_tpot_s": statistics.median(tpots),
            "collectives_s_per_token": comm / (3 * new_tokens),
            "seconds": seconds}


def probe_profile(model: Path, batch: int, new_tokens: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams

    prompts = [[(13 * i + 5 * j) % 10000 + 3 for j in range(128)] for i in range(batch)]
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(model=str(model), tp_size=2) as engine:
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))
        reqs = [engine.submit(p, sp) for p in prompts]
        while any(not r.output_ids for r in reqs):  # prefill outside the profile
            engine.scheduler.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps = 0
            while not all(r.finished() for r in reqs) and steps < new_tokens:
                engine.scheduler.step()
                steps += 1
        engine.generate([prompts[0]], SamplingParams(max_new_tokens=1))  # settle
    events = prof.key_averages()
    comm_names = ("allreduce", "all_reduce", "allgather", "all_gather", "broadcast", "gloo")
    total = sum(e.self_cpu_time_total for e in events)
    comm = sum(e.self_cpu_time_total for e in events
               if any(n in e.key.lower() for n in comm_names))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"batch": batch, "decode_steps": steps,
            "collectives_share_of_self_cpu": comm / total if total else 0.0,
            "ms_per_step": total / 1000 / max(steps, 1),
            "top_self_cpu_ms": [(e.key, e.self_cpu_time_total / 1000) for e in top]}


def _probe(kind: str, model: Path, threads: int, **kwargs: Any) -> dict[str, Any]:
    args = [__file__, "--probe", kind, "--model", str(model)]
    for key, value in kwargs.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return _run(args, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="w,memory,decode,profile")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--models", type=Path,
                        default=Path(os.environ.get("PLUGSERVE_CACHE_DIR",
                                                    Path.home() / ".cache/plugserve")) / "bench")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe is not None:
        out = {"memory": lambda: probe_memory(args.model, args.tp),
               "decode": lambda: probe_decode(args.model, args.tp, args.new_tokens),
               "profile": lambda: probe_profile(args.model, args.batch, args.new_tokens)
               }[args.probe]()
        print(json.dumps(out))
        return
    args.models.mkdir(parents=True, exist_ok=True)
    model = bench_model(args.models)
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {"model": str(model), "cpu": _cpu(), "threads_available":
                              os.cpu_count(), "load_before": os.getloadavg()}
    if "w" in parts:
        print("workload W (plugserve bench throughput):", flush=True)
        report["w"] = part_w(model, args.rounds)
    if "memory" in parts:
        report["memory"] = {f"tp{tp}": _probe("memory", model, 1, tp=tp) for tp in (1, 2)}
        one = report["memory"]["tp1"]["weights_bytes"][0]
        report["memory"]["weights_per_rank_vs_tp1"] = [
            w / one for w in report["memory"]["tp2"]["weights_bytes"]]
    if "decode" in parts:
        runs: dict[str, list[float]] = {"tp1": [], "tp2": []}
        comm: list[float] = []
        for _ in range(args.rounds):
            for tp in (1, 2):
                got = _probe("decode", model, 1, tp=tp)
                runs[f"tp{tp}"].append(got["median_tpot_s"])
                if tp == 2:
                    comm.append(got["collectives_s_per_token"])
        best = {k: min(v) for k, v in runs.items()}
        report["decode_batch1"] = {"tpot_s": runs, "best_tpot_s": best,
                                   "tp2_speed_vs_tp1": best["tp1"] / best["tp2"],
                                   "tp2_collectives_s_per_token": comm}
    if "profile" in parts:
        report["profile"] = {f"batch{b}": _probe("profile", model, 1, batch=b, new_tokens=16)
                             for b in (64, 1)}
    report["load_after"] = os.getloadavg()
    _print(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _print(report: dict[str, Any]) -> None:
    print(f"\nmodel {report['model']} on {report['cpu']}, {report['threads_available']} "
          f"cores (load {report['load_before'][0]:.1f} before, {report['load_after'][0]:.1f} "
          "after; the machine is shared)")
    if "w" in report:
        w = report["w"]
        for label, values in w["out_tok_per_s"].items():
            print(f"  W {label:26s} " + " / ".join(f"{v:.1f}" for v in values) + " out tok/s")
        print(f"  W TP=2 vs TP=1 1 thread:  {w['tp2_vs_tp1_1thread']:.2f}x (best of each; per "
              "round " + ", ".join(f"{r:.2f}x" for r in w["per_round_tp2_vs_tp1_1thread"])
              + "; goal >= 1.6x)")
        print(f"  W TP=2 vs TP=1 2 threads: {w['tp2_vs_tp1_2threads']:.2f}x (per round "
              + ", ".join(f"{r:.2f}x" for r in w["per_round_tp2_vs_tp1_2threads"])
              + "; goal >= 0.9x)")
    if "memory" in report:
        m = report["memory"]
        mib = 1 << 20
        print(f"  weights per rank: TP=1 {m['tp1']['weights_bytes'][0] / mib:.1f} MiB, TP=2 "
              + " / ".join(f"{b / mib:.1f}" for b in m["tp2"]["weights_bytes"]) + " MiB ("
              + " / ".join(f"{r:.3f}x" for r in m["weights_per_rank_vs_tp1"])
              + "; goal <= 0.6x)")
        print(f"  resident memory per process: TP=1 {m['tp1']['rss_bytes'][0] / mib:.0f} MiB, "
              "TP=2 " + " / ".join(f"{b / mib:.0f}" for b in m["tp2"]["rss_bytes"])
              + f" MiB (KV pool per rank: TP=1 {m['tp1']['kv_pool_bytes_per_rank'] / mib:.0f} "
              f"MiB for {m['tp1']['kv_pool_tokens']} tokens, TP=2 "
              f"{m['tp2']['kv_pool_bytes_per_rank'] / mib:.0f} MiB for "
              f"{m['tp2']['kv_pool_tokens']} tokens)")
    if "decode_batch1" in report:
        d = report["decode_batch1"]
        print("  batch-1 decode TPOT: TP=1 " + " / ".join(
            f"{t * 1e3:.2f}" for t in d["tpot_s"]["tp1"]) + " ms, TP=2 " + " / ".join(
            f"{t * 1e3:.2f}" for t in d["tpot_s"]["tp2"]) + f" ms: TP=2 is "
            f"{d['tp2_speed_vs_tp1']:.2f}x TP=1's speed; collectives "
            + " / ".join(f"{c * 1e3:.2f}" for c in d["tp2_collectives_s_per_token"])
            + " ms per token")
    if "profile" in report:
        for name, p in report["profile"].items():
            print(f"  profile rank 0, {name} decode ({p['decode_steps']} steps, "
                  f"{p['ms_per_step']:.1f} ms self CPU per step): collectives "
                  f"{p['collectives_share_of_self_cpu'] * 100:.0f}% of self CPU time")
            for key, ms in p["top_self_cpu_ms"][:8]:
                print(f"      {ms:9.1f} ms  {key}")


if __name__ == "__main__":
    main()
