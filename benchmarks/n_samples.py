"""n > 1: the prompt computed once and forked, against every sample prefilling its prompt.

    python benchmarks/n_samples.py [--model M|tiny] [--prompt-len 512] [--n 8] [--prompts 2]
        [--max-new 32] [--page-size 16] [--repeat 2]

Runs the same requests (temperature 1, seeded) on two engines, one after the other, in one
process: `cache=radix` (the samples fork the first's cached prompt) and `cache=none` (each
sample prefills). Prints the prefill tokens each computed, the best wall time of `--repeat`
runs, and the ratios; the forked outputs must equal the unforked ones token for token (same
seeds). Wall times on a shared machine are noisy: compare the ratio from one run.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams


def _model(name: str | None) -> str | None:
    if name != "tiny":
        return name
    from plugserve.testing.tiny_models import make_tiny_model_dir

    return str(make_tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    model = _model(args.model)
    rng = random.Random(0)
    top_id = 250 if args.model == "tiny" else 20000  # inside the vocabulary
    prompts = [[rng.randrange(100, top_id) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    sp = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, seed=1, ignore_eos=True,
                        n=args.n)
    rows: dict[str, tuple[int, float, list[list[list[int]]]]] = {}
    for cache in ("radix", "none"):
        with Engine(model=model, cache=cache, page_size=args.page_size) as engine:
            engine.generate([prompts[0][:32]], SamplingParams(max_new_tokens=2))  # warm-up
            best, tokens, outputs = float("inf"), 0, []
            for _ in range(args.repeat):
                before = engine.stats().get("prefill_tokens", 0)
                t0 = time.perf_counter()
                # The same prompts each run: empty the cache so the first sample prefills.
                engine.kv.cache.evict(engine.kv.allocator.total_slots)
                out = engine.generate(prompts, sp)
                best = min(best, time.perf_counter() - t0)
                tokens = engine.stats()["prefill_tokens"] - before
                outputs = [[s.token_ids for s in r.samples] for r in out]
        rows[cache] = (tokens, best, outputs)
    assert rows["radix"][2] == rows["none"][2], "forked samples differ from unforked ones"
    print(f"model={args.model or 'default'} prompts={args.prompts}x{args.prompt_len} tokens "
          f"n={args.n} max_new={args.max_new} page={args.page_size}")
    print(f"{'cache':8} {'prefill tokens':>15} {'best wall s':>12}")
    for cache, (tokens, wall, _) in rows.items():
        print(f"{cache:8} {tokens:>15} {wall:>12.3f}")
    print(f"prefill tokens none/radix: {rows['none'][0] / rows['radix'][0]:.2f}x; "
          f"wall none/radix: {rows['none'][1] / rows['radix'][1]:.2f}x; outputs identical")


if __name__ == "__main__":
    main()
