"""Float32 linears of a decode step: the panel GEMM against oneDNN and the few-row kernel.

Per decoder layer of the default model (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576), with 30 layers' distinct weights cycled as an engine step does, so each
layer's weights come from memory and not from a cache that still holds them:

    python benchmarks/panel_gemm_speed.py [--rows 4,8,9,16,32,64,96,128,192,256]

prints microseconds per layer for oneDNN's packed matmul (`plugserve.kernels.packed_linear`),
the panel GEMM (`plugserve.kernels.panel_gemm`) and, up to 16 rows, the few-row kernel
(`plugserve.kernels.skinny_linear`), and oneDNN's time over the panel GEMM's. MIN_ROWS and
MAX_ROWS of plugserve.kernels.panel_gemm come from this table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from plugserve.kernels import build, packed_linear, panel_gemm, skinny_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_layer_us(fn: Linear, weights: list[list[torch.Tensor]], rows: int, repeats: int) -> float:
    xs = [torch.randn(rows, k) for _, k in SHAPES]

    def step() -> None:
        for layer in weights:
            for w, x in zip(layer, xs, strict=True):
                fn(x, w)

    step()
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats / len(weights) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,8,9,16,32,64,96,128,192,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    library = build.library()
    if library is None:
        raise SystemExit(f"the CPU kernels are not available: {build.unavailable_reason()}")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    for layer in weights:  # every pack made before timing
        for w in layer:
            panel_gemm.pack(w)
            packed_linear.packed(w)

    def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        pack = packed_linear.packed(w)
        assert pack is not None
        return pack(x, None)

    def panel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return panel_gemm.panel_gemm(x, w, None)

    def skinny(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return skinny_linear.skinny_linear(x, w, None)

    print(f"float32, {torch.get_num_threads()} threads, kernels' ISA {library.isa()}; "
          f"us per layer ({LAYERS} layers' weights cycled)")
    print(f"{'rows':>5} {'oneDNN':>9} {'panel':>9} {'few-row':>9} {'oneDNN/panel':>13}")
    for rows in (int(r) for r in args.rows.split(",")):
        one = per_layer_us(onednn, weights, rows, args.repeats)
        pan = per_layer_us(panel, weights, rows, args.repeats)
        few = per_layer_us(skinny, weights, rows, args.repeats) if rows <= 16 else float("nan")
        print(f"{rows:>5} {one:>9.0f} {pan:>9.0f} {few:>9.0f} {one / pan:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
