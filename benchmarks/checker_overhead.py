"""Step time with the invariant checker at level 1 vs off, same workload, one process.

    python benchmarks/checker_overhead.py [--model PATH] [--batches 1 16 64] [--repeats 3]

Prints, per batch size, the wall time of each setting (best of the repeats, runs
interleaved so machine noise hits both) and the ratio on/off. Not a test: timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams


def _workload(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 10000) for _ in range(rng.randint(32, 96))] for _ in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engines = {
        level: Engine(model=args.model, dtype=args.dtype, mem_check=level, cache="none")
        for level in (0, 1)
    }
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for batch in args.batches:
        prompts = _workload(batch)
        best = {0: float("inf"), 1: float("inf")}
        for _ in range(args.repeats):
            for level, engine in engines.items():
                t0 = time.perf_counter()
                engine.generate(prompts, sp)
                best[level] = min(best[level], time.perf_counter() - t0)
        checker = engines[1].stats()["checker"]
        rows.append(
            {
                "batch": batch,
                "off_s": best[0],
                "level1_s": best[1],
                "ratio": best[1] / best[0],
                "checker_time_s_total": checker["check_time_s"],
                "steps_checked_total": checker["steps_checked"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
