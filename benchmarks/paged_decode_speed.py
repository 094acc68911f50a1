"""Speed of the CPU paged-decode kernel at the shapes of the throughput workload.

For each batch (rows x keys per row) and each cache dtype it times one decode attention call
of SmolLM2-135M's shape (9 query heads, 3 kv heads, head_dim 64) through
`plugserve.kernels.paged_decode`, and prints microseconds per call and the K/V bytes it reads
per second (GB/s). The calls cycle over --layers separate K/V buffers, as the layers of a
decode step do, so each call reads its cache from the last-level cache or memory, not from
the core's own caches. The slots are laid out as the engine's page-size-1 allocator leaves
them: each row's prompt half in one run of slots, its decoded half interleaved with the other
rows' (one slot per row per step). A batch is ROWSxKEYS, or ROWSxLO-HI for rows of random
lengths (seeded), as the workload's requests have.

    python benchmarks/paged_decode_speed.py [--batches 64x250,64x16-512,32x400,8x500,1x1024]
        [--dtypes bfloat16,float32] [--isa avx512] [--repeats 7] [--layers 30] [--contiguous]

The query dtype is the cache's. Best of --repeats; --isa forces a kernel copy; --contiguous
lays each row's keys in one run of slots (the layout large pages would give).
"""

from __future__ import annotations

import argparse
import os

import torch

from plugserve.bench.bandwidth import GB, best_seconds
from plugserve.kernels import isa as isa_mod
from plugserve.kernels import paged_decode as pd

HEADS, KV_HEADS, DIM = 9, 3, 64
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def engine_slots(lens: list[int], contiguous: bool = False) -> tuple[torch.Tensor, int]:
    """[rows, max(lens)] slot table: each row's prompt half in one run, the decoded halves
    interleaved (one slot per still-decoding row per step), and the number of slots used.
    `contiguous`: every row's keys in one run instead."""
    rows, width = len(lens), max(lens)
    slots = torch.zeros(rows, width, dtype=torch.int64)
    prompts = list(lens) if contiguous else [n // 2 for n in lens]
    used = 0
    for i, p in enumerate(prompts):
        slots[i, :p] = torch.arange(used, used + p)
        used += p
    for step in range(width - min(prompts) if not contiguous else 0):
        for i, (n, p) in enumerate(zip(lens, prompts, strict=True)):
            if p + step < n:
                slots[i, p + step] = used
                used += 1
    return slots, used


def batch_lens(spec: str) -> list[int]:
    """'64x250': 64 rows of 250 keys; '64x16-512': 64 rows of 16 to 512 (seeded)."""
    rows, _, length = spec.partition("x")
    lo, _, hi = length.partition("-")
    if not hi:
        return [int(lo)] * int(rows)
    gen = torch.Generator().manual_seed(1)
    return torch.randint(int(lo), int(hi) + 1, (int(rows),), generator=gen).tolist()


def time_batch(lens: list[int], dtype: torch.dtype, layers: int, repeats: int,
               contiguous: bool = False) -> tuple[float, float]:
    """(us per call, GB/s of K/V read) of `layers` calls over separate buffers."""
    gen = torch.Generator().manual_seed(0)
    rows = len(lens)
    slots, num_slots = engine_slots(lens, contiguous)
    first = torch.zeros(rows, dtype=torch.int64)
    kv_lens = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(dtype)
    bufs = [(torch.randn(num_slots, KV_HEADS, DIM, generator=gen).to(dtype),
             torch.randn(num_slots, KV_HEADS, DIM, generator=gen).to(dtype))
            for _ in range(layers)]

    def step() -> None:
        for k, v in bufs:
            pd.paged_decode(q, k, v, slots, first, kv_lens, DIM**-0.5)

    seconds = best_seconds(step, repeats) / layers
    nbytes = 2 * sum(lens) * KV_HEADS * DIM * torch.finfo(dtype).bits // 8
    return seconds * 1e6, nbytes / seconds / GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64x250,64x16-512,32x400,8x500,1x1024")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--isa", default=None, help="force a kernel copy (default: the best)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--contiguous", action="store_true",
                        help="each row's keys in one run of slots (as with large pages)")
    args = parser.parse_args()
    if args.isa:  # the library then holds only that copy
        os.environ[isa_mod.ENV_ISA] = args.isa
    if not pd.available():
        raise SystemExit(f"paged_decode kernel unavailable: {pd.why_unavailable()}")
    from plugserve.kernels import build

    library = build.library()
    isa = library.isa() if library is not None else "?"
    print(f"paged_decode: {HEADS} heads, {KV_HEADS} kv heads, head_dim {DIM}; ISA {isa}; "
          f"{torch.get_num_threads()} threads; {args.layers} layers")
    print(f"{'batch':>11} {'dtype':>9} {'us/call':>9} {'GB/s':>7}")
    for spec in args.batches.split(","):
        for name in args.dtypes.split(","):
            us, gbs = time_batch(batch_lens(spec), DTYPES[name], args.layers, args.repeats,
                                 args.contiguous)
            print(f"{spec:>11} {name:>9} {us:>9.1f} {gbs:>7.1f}")


if __name__ == "__main__":
    main()
