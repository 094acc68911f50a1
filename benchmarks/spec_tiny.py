"""EAGLE on the tiny target: plain vs chain vs tree decoding, side by side in one run.

    python benchmarks/spec_tiny.py [--prompts 8] [--new-tokens 32] [--repeats 3]
                                   [--batched] [--threads 1] [--json]

Builds the tiny random Llama target (`plugserve.testing.tiny_models`) and trains a tiny EAGLE
head for it (`plugserve_spec_eagle.testing.make_tiny_head_dir(..., trained=True)`, a few
seconds) in a temporary folder, then decodes a fixed set of seeded prompts greedily with:

- plain: no speculation;
- chain: EAGLE, topk 1, 3 steps (4 tokens verified per round);
- tree: EAGLE, topk 4, 3 steps, 8 draft tokens verified per round;

each at page_size 1 and 16. Reported per configuration:

- mean acceptance length: tokens emitted per verify round (accepted draft tokens + bonus);
- target forwards per output token: (prefill forwards + verify rounds) / output tokens,
  counted per request (plain: one forward per token = 1.0);
- output tokens/s: wall clock, best of --repeats; the configurations run interleaved so
  machine noise hits them alike. By default requests run one at a time (latency-bound, where
  speculation pays); --batched submits them all at once.

Every speculative output is checked against the plain output (greedy is lossless); a
mismatch is reported and the exit code is 1. Not a test: timings are noisy, and on a tiny
CPU model the drafting overhead is large next to a target forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams


@dataclass(frozen=True, eq=False)  # hashed by identity: keys of the per-config dicts
class Config:
    name: str
    page_size: int
    spec: dict[str, Any] = field(default_factory=dict)

    def engine_args(self, head_dir: Path) -> dict[str, Any]:
        if not self.spec:
            return {}
        return {"spec": "eagle", "draft_model": str(head_dir), **self.spec}


SPECS: dict[str, dict[str, Any]] = {
    "plain": {},
    "chain": {"spec_steps": 3, "spec_topk": 1},
    "tree": {"spec_steps": 3, "spec_topk": 4, "spec_draft_tokens": 8},
}


@dataclass
class Row:
    page_size: int
    config: str
    output_tokens: int
    verify_rounds: int
    prefill_forwards: int
    mean_accept_len: float | None
    forwards_per_token: float
    best_s: float
    tokens_per_s: float
    speedup: float = 1.0
    identical_to_plain: bool = True


def run_once(engine: Engine, prompts: list[list[int]], sampling: SamplingParams,
             batched: bool) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    if batched:
        results = engine.generate(prompts, sampling)
    else:
        results = [engine.generate([p], sampling)[0] for p in prompts]
    return time.perf_counter() - t0, results


def summarise(config: Config, results: list[Any], best_s: float, chunk: int) -> Row:
    out = sum(r.output_tokens for r in results)
    rounds = sum(r.stats.get("spec_verify_steps", 0) for r in results)
    accepted = sum(r.stats.get("spec_accepted_tokens", 0) for r in results)
    # Each prompt is prefilled in ceil(len / chunk) forwards (no prefix cache in this run).
    prefill = sum(-(-r.prompt_tokens // chunk) for r in results)
    if config.spec:
        forwards = prefill + rounds
        mean_accept = (accepted + rounds) / rounds if rounds else None
    else:
        forwards = prefill + sum(max(r.output_tokens - 1, 0) for r in results)
        mean_accept = None
    return Row(
        page_size=config.page_size, config=config.name, output_tokens=out,
        verify_rounds=rounds, prefill_forwards=prefill, mean_accept_len=mean_accept,
        forwards_per_token=forwards / out, best_s=best_s, tokens_per_s=out / best_s,
    )


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    mode = "batched" if args.batched else "one request at a time"
    print(f"tiny target, trained tiny EAGLE head; {args.prompts} prompts x {args.new_tokens} "
          f"new tokens, greedy, {mode}, {args.threads} thread(s), best of {args.repeats}")
    header = (f"{'page':>4}  {'config':<6}  {'accept len':>10}  {'fwd/token':>9}  "
              f"{'rounds':>6}  {'tok/s':>8}  {'vs plain':>8}  {'same as plain':>13}")
    print(header)
    print("-" * len(header))
    for r in rows:
        accept = "-" if r.mean_accept_len is None else f"{r.mean_accept_len:.2f}"
        rounds = "-" if r.config == "plain" else str(r.verify_rounds)
        same = "-" if r.config == "plain" else ("yes" if r.identical_to_plain else "NO")
        print(f"{r.page_size:>4}  {r.config:<6}  {accept:>10}  {r.forwards_per_token:>9.3f}  "
              f"{rounds:>6}  {r.tokens_per_s:>8.1f}  {r.speedup:>7.2f}x  {same:>13}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="number of prompts")
    parser.add_argument("--prompt-len", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--batched", action="store_true",
                        help="submit every prompt at once instead of one at a time")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=1,
                        help="prompt seed (the head trains on seed 0's prompts)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from plugserve.testing.tiny_models import make_tiny_model_dir
    from plugserve_spec_eagle.testing import make_tiny_head_dir, tiny_prompts

    prompts = tiny_prompts(args.seed, count=args.prompts, length=args.prompt_len)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    chunk = 2048  # the engine's default chunked_prefill_size
    with tempfile.TemporaryDirectory(prefix="spec_tiny_") as tmp:
        target = make_tiny_model_dir(Path(tmp) / "target", arch="llama", seed=0)
        t0 = time.perf_counter()
        head = make_tiny_head_dir(target, Path(tmp) / "head", trained=True)
        train_s = time.perf_counter() - t0
        configs = [Config(name, page, spec) for page in args.pages
                   for name, spec in SPECS.items()]
        engines = {
            c: Engine(model=str(target), dtype="float32", page_size=c.page_size, cache="none",
                      chunked_prefill_size=chunk, **c.engine_args(head))
            for c in configs
        }
        try:
            outputs: dict[Config, list[Any]] = {}
            best = dict.fromkeys(configs, float("inf"))
            for c, engine in engines.items():  # warm-up, and the outputs to compare
                _, outputs[c] = run_once(engine, prompts, sampling, args.batched)
            for _ in range(args.repeats):
                for c, engine in engines.items():
                    elapsed, _ = run_once(engine, prompts, sampling, args.batched)
                    best[c] = min(best[c], elapsed)
        finally:
            for engine in engines.values():
                engine.close()

    rows = []
    plain_of = {c.page_size: c for c in configs if not c.spec}
    for c in configs:
        row = summarise(c, outputs[c], best[c], chunk)
        ref = plain_of[c.page_size]
        row.identical_to_plain = ([r.token_ids for r in outputs[c]]
                                  == [r.token_ids for r in outputs[ref]])
        row.speedup = best[ref] / best[c]
        rows.append(row)

    if args.json:
        print(json.dumps({
            "settings": {**vars(args), "head_train_s": train_s},
            "rows": [vars(r) for r in rows],
        }, indent=2))
    else:
        print_table(rows, args)
    mismatched = [r for r in rows if not r.identical_to_plain]
    for r in mismatched:
        print(f"error: page {r.page_size} {r.config}: output differs from plain greedy",
              file=sys.stderr)
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
