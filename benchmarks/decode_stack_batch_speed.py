"""A decode batch through the compiled decode stack (`plugserve.kernels.decode_layer`,
`DecodeStack.run`: all layers in one call) against the same kernels called op by op from
Python (`run_reference`), per row count: milliseconds per step over the default model's
shape (30 layers; 576 hidden, 9 / 3 heads of 64, 1,536 intermediate), each row attending
to its own context of 100-250 cached tokens.

    python benchmarks/decode_stack_batch_speed.py [--dtype bfloat16] [--rows 16,32,64,96]

Weights are random (the kernels' speed does not depend on the values); the batch packs are
made before timing, as the server does at start; best of --repeats steps. The op-by-op side
leaves out the model's own module calls, so the saving in the engine is somewhat larger.
"""

from __future__ import annotations

import argparse

import torch

from plugserve.bench.bandwidth import best_seconds
from plugserve.kernels import decode_layer as dl
from plugserve.kernels.paged_decode import PagedDecodePlan

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30


def _layer(gen: torch.Generator, dtype: torch.dtype) -> dl.LayerWeights:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)

    norm = torch.ones(HIDDEN, dtype=dtype)
    return dl.LayerWeights(norm, 1e-5, w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), None,
                           HEADS, KV_HEADS, HEAD_DIM, w(HIDDEN, HEADS * HEAD_DIM), None,
                           norm.clone(), 1e-5, w(2 * INTER, HIDDEN), None, w(HIDDEN, INTER),
                           None)


def _plan(gen: torch.Generator, rows: int, dtype: torch.dtype) -> PagedDecodePlan:
    lens = torch.randint(100, 251, (rows,), generator=gen)
    slots_total = int(lens.sum())
    k = torch.randn(slots_total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = torch.zeros(rows, int(lens.max()), dtype=torch.int64)
    start = 0
    for i, n in enumerate(lens.tolist()):
        slots[i, :n] = torch.arange(start, start + n)
        start += n
    store = slots[torch.arange(rows), lens - 1].clone()
    return PagedDecodePlan(k, k.clone(), store, slots, torch.zeros_like(lens), lens,
                           HEAD_DIM**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="16,32,64,96")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    stack = dl.DecodeStack([_layer(gen, dtype) for _ in range(LAYERS)])
    print(f"{args.dtype}, {args.threads} threads, {LAYERS} layers; ms per decode step")
    print("rows  op by op  stack  op-by-op / stack")
    for rows in (int(r) for r in args.rows.split(",")):
        _time_rows(stack, rows, dtype, gen, args.repeats)


def _time_rows(stack: dl.DecodeStack, rows: int, dtype: torch.dtype, gen: torch.Generator,
               repeats: int) -> None:
    hidden = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    if not stack.takes_batch(hidden):
        print(f"{rows:4d}  (no batch kernel of the stack takes {rows} rows here)")
        return
    angles = torch.rand(rows, HEAD_DIM // 2, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    plans = [_plan(gen, rows, dtype) for _ in range(LAYERS)]
    with torch.inference_mode():
        stack.run(hidden, cos, sin, plans)  # makes the packs
        ref = best_seconds(lambda: stack.run_reference(hidden, cos, sin, plans), repeats)
        ours = best_seconds(lambda: stack.run(hidden, cos, sin, plans), repeats)
    print(f"{rows:4d}  {ref * 1e3:8.2f}  {ours * 1e3:5.2f}  {ref / ours:.3f}")

if __name__ == "__main__":
    main()
