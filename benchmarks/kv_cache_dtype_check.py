"""How far a narrower KV cache moves greedy decoding: `--kv-cache-dtype` against the model's
own dtype on the shipped chat prompts (`plugserve/bench/data/chat_prompts.jsonl`).

For each weight dtype and each narrower KV cache dtype, every prompt is decoded greedily
(chat template, `--output-len` tokens, EOS ignored) by an engine with the full-precision
cache ("auto") and one with the narrower cache. Printed per pair:

- greedy agreement: the share of output tokens before the first one that differs (the mean
  over prompts of common prefix / output length), and how many prompts are identical whole;
- mean |delta logprob|: over the common prefix (the same context on both sides), the mean
  absolute difference of the chosen tokens' log-probabilities, and the mean signed one
  (narrower minus full precision).

    flock /tmp/plugserve-bench.lock .venv/bin/python benchmarks/kv_cache_dtype_check.py
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from plugserve.engine import Engine
from plugserve.outputs import GenerateResult
from plugserve.sampling import SamplingParams

KV_DTYPES = ("bfloat16", "float8_e4m3", "float8_e5m2")


def chat_prompts(n: int) -> list[str]:
    text = resources.files("plugserve.bench").joinpath("data", "chat_prompts.jsonl").read_text(
        encoding="utf-8")
    prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return prompts[:n]


def run(dtype: str, kv: str, prompts: list[str], output_len: int) -> list[GenerateResult]:
    sp = SamplingParams(max_new_tokens=output_len, ignore_eos=True, logprobs=True)
    with Engine(dtype=dtype, kv_cache_dtype=kv) as engine:
        return engine.generate(prompts, sp, chat=True)


def compare(full: list[GenerateResult], narrow: list[GenerateResult]) -> dict[str, float]:
    shares, identical, abs_diffs, diffs = [], 0, [], []
    for a, b in zip(full, narrow, strict=True):
        common = 0
        for x, y in zip(a.token_ids, b.token_ids, strict=True):
            if x != y:
                break
            common += 1
        shares.append(common / len(a.token_ids))
        identical += int(common == len(a.token_ids))
        assert a.logprobs is not None and b.logprobs is not None
        for k in range(common):
            diffs.append(b.logprobs[k] - a.logprobs[k])
            abs_diffs.append(abs(diffs[-1]))
    return {
        "agreement": sum(shares) / len(shares),
        "identical": identical,
        "mean_abs_dlogprob": sum(abs_diffs) / max(1, len(abs_diffs)),
        "mean_dlogprob": sum(diffs) / max(1, len(diffs)),
        "compared_tokens": len(diffs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48, help="chat prompts (of 48)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"],
                        help="weight dtype (repeatable; default both)")
    args = parser.parse_args()
    prompts = chat_prompts(args.prompts)
    print(f"{len(prompts)} chat prompts x {args.output_len} greedy tokens, SmolLM2-135M")
    print(f"{'weights':>9} {'kv cache':>12} {'agreement':>10} {'identical':>10} "
          f"{'mean |dlp|':>11} {'mean dlp':>10} {'tokens':>7} {'s':>5}")
    for dtype in args.dtype or ["float32", "bfloat16"]:
        full = run(dtype, "auto", prompts, args.output_len)
        for kv in KV_DTYPES:
            if kv == dtype:
                continue  # the model's own dtype: "auto"
            start = time.perf_counter()
            got = compare(full, run(dtype, kv, prompts, args.output_len))
            print(f"{dtype:>9} {kv:>12} {got['agreement']:>10.3f} "
                  f"{got['identical']:>4}/{len(prompts):<5} {got['mean_abs_dlogprob']:>11.4f} "
                  f"{got['mean_dlogprob']:>+10.4f} {got['compared_tokens']:>7} "
                  f"{time.perf_counter() - start:>5.0f}", flush=True)


if __name__ == "__main__":
    main()
