"""Workload `long-context`: long prompts on a hybrid sliding-window model, SWA pools vs one
full pool, under the same KV memory budget.

N requests of `context_len` tokens (prompt + `output_len` new tokens, EOS ignored) are all
submitted at once to two engines that get the same KV budget in bytes:

- `swa`: the full pool holds only the full-attention layers; the windowed layers' pool holds
  what the running requests' windows need (`max_running x (window + 2 pages) + one prefill
  chunk`); the budget is split so that every request's full KV fits next to it;
- `full`: the same model forced onto one full pool (`swa_pools=False`), every layer's KV for
  every position.

Measured by running the requests (not arithmetic): the most requests running at once, the
peak KV slots used per pool, and the most SWA-layer KV one running (decoding) request held.
Without `--model` the model is a tiny random Gemma-3-shaped one built in code (6 layers, 5
local : 1 global, window `window`), so it runs on a CPU in about a minute. Targets (reported):
SWA KV per running request <= window + 2 pages (+ a speculative reserve, none here); >= 2.5x
the requests of `full` at 4,096-token contexts with a 512-token window.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugserve.bench.runner import derive, new_report
from plugserve.pools.allocator import ceil_align

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.runner import Runner
    from plugserve.config import EngineConfig
    from plugserve.engine import Engine

NAME = "long-context"
OWN_REPORT = True  # its runs are memory figures, not the serving metrics table
ENGINE_FIELDS_SET = ("cache", "page_size", "kv_pool_tokens")
MODES = ("swa", "full")
CONCURRENCY_TARGET = 2.5


@dataclass(frozen=True)
class LongContextOptions:
    num_seqs: int = 24
    context_len: int = 4096
    output_len: int = 32
    window: int = 512
    page_size: int = 16
    chunk: int = 512
    kv_budget_mib: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_seqs", "context_len", "output_len", "window", "page_size", "chunk",
                     "kv_budget_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_len >= self.context_len:
            raise ValueError(f"output_len ({self.output_len}) must be below context_len "
                             f"({self.context_len})")


def tiny_gemma3(folder: Path, window: int, context_len: int) -> Path:
    """A tiny random Gemma-3-shaped model: 6 layers, 5 local (window) : 1 global."""
    from plugserve.testing.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(folder, arch="gemma3", seed=0, sliding_window=window,
                               max_position_embeddings=context_len + 64)


def split_budget(options: LongContextOptions, full_layers: int, swa_layers: int,
                 token_layer_bytes: int) -> dict[str, int]:
    """Pool sizes (tokens) for each mode under the same byte budget."""
    budget = options.kv_budget_mib << 20
    page = options.page_size
    one_pool = budget // ((full_layers + swa_layers) * token_layer_bytes)
    # SWA mode: per running request its whole context in the full layers and its window
    # (+ 2 pages) in the windowed layers; one prefill chunk on top in the SWA pool.
    per_req = ceil_align(options.window, page) + 2 * page
    budget_tokens = budget // token_layer_bytes  # layer-tokens
    fits = (budget_tokens - swa_layers * options.chunk) // (
        full_layers * options.context_len + swa_layers * per_req)
    swa_tokens = max(fits, 1) * per_req + options.chunk
    full_tokens = (budget_tokens - swa_layers * swa_tokens) // max(full_layers, 1)
    return {"full_only": one_pool, "full": full_tokens, "swa": swa_tokens}


def engine_configs(base: EngineConfig, options: LongContextOptions) -> dict[str, EngineConfig]:
    common = dict(cache="none", page_size=options.page_size, chunked_prefill_size=options.chunk,
                  max_prefill_tokens=max(options.chunk, 1), max_running_requests=64,
                  context_len=options.context_len)
    return {"swa": derive(base, swa_pools=True, **common),
            "full": derive(base, swa_pools=False, **common)}


def _drive(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Run every request to the end; track concurrency and per-request SWA KV held."""
    from plugserve.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    reqs = [engine.submit(p, params) for p in prompts]
    sched, kv = engine.scheduler, engine.kv
    swa_pool = kv.pools[1] if len(kv.pools) > 1 else None
    peak_running, swa_per_req = 0, 0
    while True:
        progressed = sched.step()
        running = [r for r in sched.running_batch.reqs if r.req_pool_idx is not None
                   and not r.finished()]
        peak_running = max(peak_running, len(running))
        if swa_pool is not None:
            swa_per_req = max([swa_per_req, *(swa_pool.req_uncached(r) for r in running)])
        if not progressed and sched.is_idle():
            sched.settle_idle()
            break
    bad = [r.error for r in reqs if r.error or len(r.output_ids) != output_len]
    if bad:
        raise RuntimeError(f"long-context: {len(bad)} request(s) did not complete: {bad[:3]}")
    return {
        "peak_running_requests": peak_running,
        "retracted_reqs": int(sched.stats.get("retracted_reqs", 0)),
        "peak_slots_used": {p.name: p.allocator.peak_used_pages * p.allocator.page_size
                            for p in kv.pools},
        "pool_slots": {p.name: p.total for p in kv.pools},
        "max_swa_slots_per_running_request": swa_per_req if swa_pool is not None else None,
    }


def run(runner: Runner, options: LongContextOptions,
        comparison: Comparison | None) -> dict[str, Any]:
    import time

    from plugserve.engine import Engine

    report = new_report(runner, {"name": NAME, **vars(options)})
    rng = random.Random(options.seed)
    prompt_len = options.context_len - options.output_len
    with tempfile.TemporaryDirectory() as tmp:
        model = runner.config.model or str(tiny_gemma3(Path(tmp) / "gemma3", options.window,
                                                        options.context_len))
        configs = engine_configs(derive(runner.config, model=model), options)
        with Engine(configs["full"], plugins=runner.plugins) as probe:
            arch = probe.arch
            vocab = int(arch.vocab_size)
            token_layer_bytes = probe.kv_pool.get_k(0).element_size() * 2 * (
                arch.num_key_value_heads * arch.head_dim)
        full_layers, swa_layers = (len(arch.full_attention_layer_ids),
                                   len(arch.sliding_window_layer_ids))
        sizes = split_budget(options, full_layers, swa_layers, token_layer_bytes)
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)]
                   for _ in range(options.num_seqs)]
        for mode in MODES:
            cfg = configs[mode]
            if mode == "swa":
                cfg = derive(cfg, kv_pool_tokens=sizes["full"], swa_pool_tokens=sizes["swa"])
            else:
                cfg = derive(cfg, kv_pool_tokens=sizes["full_only"])
            with Engine(cfg, plugins=runner.plugins) as engine:
                t0 = time.perf_counter()
                measured = _drive(engine, prompts, options.output_len)
                measured["seconds"] = time.perf_counter() - t0
                measured["kv_bytes"] = sum(
                    t.numel() * t.element_size()
                    for buf in (engine.kv_pool.k_buffer, engine.kv_pool.v_buffer)
                    for t in buf.values())
            report["runs"].append({"settings": {"pools": mode}, **measured})
    report["summary"] = summarize(report["runs"], options)
    return report


def summarize(runs: list[dict[str, Any]], options: LongContextOptions) -> dict[str, Any]:
    by = {r["settings"]["pools"]: r for r in runs}
    swa, full = by["swa"], by["full"]
    ratio = swa["peak_running_requests"] / max(full["peak_running_requests"], 1)
    held = swa["max_swa_slots_per_running_request"]
    bound = ceil_align(options.window, options.page_size) + 2 * options.page_size
    return {
        "concurrency_ratio": ratio,
        "swa_slots_per_running_request": held,
        "swa_slots_bound": bound,
        "targets": {
            "swa_per_request_le_window_plus_2_pages": held is not None and held <= bound,
            "concurrency_ge_2.5x": ratio >= CONCURRENCY_TARGET,
        },
    }


def print_tables(report: dict[str, Any]) -> None:
    """The per-pool table (markdown, as in the README)."""
    print("| pools | KV bytes | requests at once | peak full slots | peak swa slots "
          "| max swa slots / running req | retracted | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for run_ in report["runs"]:
        peak = run_["peak_slots_used"]
        print(f"| {run_['settings']['pools']} | {run_['kv_bytes']:,} | "
              f"{run_['peak_running_requests']} | {peak.get('full', 0):,} | "
              f"{peak.get('swa', '-')} | {run_['max_swa_slots_per_running_request'] or '-'} | "
              f"{run_['retracted_reqs']} | {run_['seconds']:.1f} |")
    s = report["summary"]
    print(f"concurrency ratio swa/full: {s['concurrency_ratio']:.2f}x; targets: {s['targets']}")
