"""The dense bf16 linear on AMX tiles (`plugserve.kernels.dense_amx`) against oneDNN's packed
matmul (`plugserve.kernels.packed_linear`), per row count: microseconds per layer of the
default model (its four linears: qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576), weights cold as in the engine (30 layers' distinct weights cycled, 7 MB each in
bf16), and the weight bytes read per second that makes. `MAX_ROWS` in that module is the
largest row count where the kernel is faster.

    python benchmarks/dense_amx_speed.py [--rows 9,16,32,64,96,128,256] [--threads 2]

With `--prefill` (rows 128,512,1024,2048 unless given) each matrix is timed on its own,
TFLOP/s of oneDNN and of the kernel, and which one the model's linear takes at those rows
(`dense_amx.applies_many`): the kernel's panels against oneDNN for a prefill chunk.

Weights are random (the kernels' speed does not depend on the values); best of --repeats
passes over all layers.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from plugserve.bench.bandwidth import best_seconds
from plugserve.kernels import dense_amx
from plugserve.kernels.packed_linear import PackedWeight, packed

# (out, in) of the default model's matrices per layer: qkv, o, gate_up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=None)
    parser.add_argument("--prefill", action="store_true",
                        help="per matrix, at a prefill's rows (TFLOP/s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not dense_amx.amx_usable():
        raise SystemExit("no AMX here: the CPU lacks AMX-BF16, the OS refused the tile state, "
                         "or the kernels were built without AMX")
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
               for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    onednn: list[PackedWeight] = []
    for w in weights:
        pack = packed(w)
        if pack is None:
            raise SystemExit("no packed oneDNN bf16 matmul on this CPU")
        onednn.append(pack)
        dense_amx.packed(w)
    layer_bytes = sum(n * k * 2 for n, k in LAYER_SHAPES)
    if args.prefill:
        _per_matrix(args, weights, onednn, gen)
        return
    print(f"bf16, {args.threads} threads, {LAYERS} layers of {layer_bytes / 1e6:.1f} MB cycled; "
          "us per layer (GB/s of weights)")
    for rows in (int(r) for r in (args.rows or "9,16,32,64,96,128,256").split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in LAYER_SHAPES}
        inputs = [xs[w.shape[1]] for w in weights]

        def per_layer_us(fn: Callable[[], object]) -> float:
            return best_seconds(fn, args.repeats) / LAYERS * 1e6

        with torch.inference_mode():
            base = per_layer_us(lambda inputs=inputs: [
                p(x, None) for x, p in zip(inputs, onednn, strict=True)])
            amx = per_layer_us(lambda inputs=inputs: [
                dense_amx.dense_amx_linear(x, w, None)
                for x, w in zip(inputs, weights, strict=True)])
        print(f"rows {rows:3d}: oneDNN {base:6.0f} us ({layer_bytes / base / 1e3:4.1f} GB/s), "
              f"AMX kernel {amx:6.0f} us ({layer_bytes / amx / 1e3:4.1f} GB/s), "
              f"oneDNN / kernel {base / amx:.2f}", flush=True)


def _per_matrix(args: argparse.Namespace, weights: list[torch.Tensor],
                onednn: list[PackedWeight], gen: torch.Generator) -> None:
    count = len(LAYER_SHAPES)
    print(f"bf16, {args.threads} threads, each matrix over its {LAYERS} layers' weights; "
          "TFLOP/s (the model's linear takes the starred one)")
    for rows in (int(r) for r in (args.rows or "128,512,1024,2048").split(",")):
        for i, (n, k) in enumerate(LAYER_SHAPES):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            ws, packs = weights[i::count], onednn[i::count]
            with torch.inference_mode():
                base = best_seconds(lambda x=x, packs=packs: [p(x, None) for p in packs],
                                    args.repeats)
                amx = best_seconds(lambda x=x, ws=ws: [
                    dense_amx.dense_amx_linear(x, w, None) for w in ws], args.repeats)
            tflop = 2 * rows * n * k * LAYERS / 1e12
            kernel = dense_amx.applies_many(x, ws[0])
            print(f"rows {rows:5d} {n:5d}x{k:<5d}: oneDNN {tflop / base:5.2f}{' ' if kernel else '*'}"
                  f" kernel {tflop / amx:5.2f}{'*' if kernel else ' '}  oneDNN / kernel "
                  f"{base / amx:.2f}", flush=True)


if __name__ == "__main__":
    main()
