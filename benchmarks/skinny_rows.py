"""Where the few-row linear kernel stops beating the GEMM library: the time of one decode
step's linears (every matrix of the default model's shape, 30 layers and the LM head) through
`plugserve.kernels.skinny_linear` and through the packed oneDNN matmul, per row count.
`MAX_ROWS` / `MAX_ROWS_BF16` in that module are the largest row counts where it is faster.

    python benchmarks/skinny_rows.py [--dtype bfloat16] [--rows 1,2,4,8,12,16,32] [--threads 2]

Weights are random (the kernels' speed does not depend on the values); best of --repeats.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from plugserve.bench.bandwidth import best_seconds
from plugserve.kernels import skinny_linear
from plugserve.kernels.packed_linear import packed

# (out, in) of the default model's matrices per layer: qkv, o, gate_up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
LM_HEAD = (49152, 576)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    return best_seconds(fn, repeats) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", default="1,2,4,8,12,16,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not skinny_linear.available() or (dtype == torch.bfloat16 and not skinny_linear.takes_bf16()):
        raise SystemExit(f"the kernel does not take {args.dtype} here: "
                         f"{skinny_linear.why_unavailable() or 'no AVX512-BF16'}")
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    weights = [(torch.randn(n, k, generator=gen) * k**-0.5).to(dtype) for n, k in shapes]
    packs = [packed(w) for w in weights]
    if any(p is None for p in packs):
        raise SystemExit(f"no packed GEMM-library path for {args.dtype} on this CPU")
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(f"{args.dtype}, {args.threads} threads, {megabytes:.0f} MB of weights per step")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {k for _, k in shapes}}
        inputs = [xs[w.shape[1]] for w in weights]
        pairs = list(zip(inputs, weights, packs, strict=True))
        with torch.inference_mode():
            kernel = best_ms(
                lambda pairs=pairs: [skinny_linear.skinny_linear(x, w, None) for x, w, _ in pairs],
                args.repeats,
            )
            library = best_ms(
                lambda pairs=pairs: [p(x, None) for x, _, p in pairs if p is not None],
                args.repeats,
            )
        print(f"rows {rows:3d}: kernel {kernel:7.2f} ms, packed GEMM {library:7.2f} ms, "
              f"kernel / GEMM {kernel / library:.2f}", flush=True)

if __name__ == "__main__":
    main()
