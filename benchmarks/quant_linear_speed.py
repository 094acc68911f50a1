"""Batch-1 speed of the quantized few-row linear kernel against the dense one.

For each block format and each matrix shape of SmolLM2-135M (576x576, 1536x576, 576x1536,
49152x576) it times one x[1, cols] @ W.T through `plugserve.kernels.quant_linear.few_rows`
(int8 and float activations) and through the dense few-row kernel (`skinny_linear`, fp32 and
bf16 weights), and prints the weight bytes read per second (GB/s) and the time against the
dense fp32 one. Each timed call reads a different copy of the weight, from a set of copies
larger than the caches, so every call streams from memory as a decode step does. The
machine's read bandwidth (`sum()` of a large fp32 tensor) is printed for scale.

    python benchmarks/quant_linear_speed.py [--threads 2] [--formats q4_1,q8_0] [--repeats 5]
        [--rows 1]

Weights are random valid blocks (speed does not depend on the values); best of --repeats.
The K-quants (256-weight superblocks) apply only to the 1536-column matrix.

`--many 16,64,256,1024` times the many-row path instead (prefill and batched decode): ms per
call of x[M, cols] @ W.T for each M through `quant_linear.many_rows` (int8 activations with
float32 and bf16 x, float activations with bf16 and float32 x; `--kernels auto` as the engine
chooses (AMX where the CPU has it, else VNNI for int8 activations, else on the avx2 copy
the AVX2 integer kernel), `vnni`, `maddubs`, or `strips` for the dequantize-and-GEMM path),
against the dense bf16 and float32 `F.linear` and the dequantization of the whole matrix to
bf16. The weight stays in the caches
(as in a prefill, where many rows share it).

    python benchmarks/quant_linear_speed.py --many 16,64,256,1024 [--formats q8_0,q4_k]
        [--shapes 1536x576,576x1536] [--kernels auto|vnni|maddubs|strips]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

from plugserve.bench.bandwidth import GB, best_seconds, measure_bandwidth
from plugserve.kernels import build, skinny_linear
from plugserve.kernels import quant_linear as ql
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.types import KEPT_TYPES

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out, in)
STREAM_BYTES = 256 * 2**20  # weight copies per measurement: well past the caches


def read_bandwidth(repeats: int) -> float:
    return measure_bandwidth(STREAM_BYTES >> 20, repeats)["read_gb_s"]


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> QuantBlocks:
    """Random bytes with every block's fp16 scale (and min) fields set to small values."""
    qtype = KEPT_TYPES[name]
    blocks = rng.integers(0, 256, (rows, cols // qtype.block_elems, qtype.block_bytes),
                          dtype=np.uint8)
    small = np.full(blocks.shape[:2], 1e-3, dtype=np.float16).view(np.uint8)
    fields = [208] if name == "q6_k" else [0, 2] if name in ("q4_1", "q5_1", "q4_k", "q5_k") else [0]
    for at in fields:
        blocks[..., at:at + 2] = small.reshape(*blocks.shape[:2], 2)
    return QuantBlocks(qtype, torch.from_numpy(blocks.reshape(rows, -1)), rows, cols)


def stream_gb_s(calls: list[Callable[[], object]], nbytes: int, repeats: int) -> float:
    """GB/s of running every call once (each reads its own copy of `nbytes`)."""
    def run() -> None:
        for call in calls:
            call()

    return len(calls) * nbytes / best_seconds(run, repeats) / GB


WIDTHS = (10, 10, 11, 10, 11, 10)


def row_times(w: QuantBlocks, wd: torch.Tensor, x: torch.Tensor, kernels: str,
              ms: Callable[[Callable[[], object]], float]) -> list[float]:
    """ms of the many-row columns of the table for x (float32) and w (wd: dequantized, bf16)."""
    xb, wf = x.bfloat16(), wd.float()
    return [ms(lambda: ql.many_rows(x, w, None, "int8", kernels)),
            ms(lambda: ql.many_rows(xb, w, None, "int8", kernels)),
            ms(lambda: ql.many_rows(xb, w, None, "float", kernels)),
            ms(lambda: ql.many_rows(x, w, None, "float", kernels)),
            ms(lambda: torch.nn.functional.linear(xb, wd)),
            ms(lambda: torch.nn.functional.linear(x, wf))]


def many_rows_table(rows: list[int], formats: list[str], shapes: list[tuple[int, int]],
                    kernels: str, repeats: int) -> None:
    """ms per call of the many-row path against the dense GEMMs (see the module doc)."""
    rng = np.random.default_rng(0)

    def ms(fn: Callable[[], object]) -> float:
        return best_seconds(fn, repeats) * 1e3

    amx = kernels == "auto" and ql.amx_available()
    vnni = not amx and kernels in ("auto", "vnni") and ql.vnni_available()
    library = build.library()
    assert library is not None
    maddubs = not amx and not vnni and ql.maddubs_available() and (
        kernels == "maddubs" or (kernels == "auto" and library.isa() == "avx2"))
    path = "AMX" if amx else "VNNI for int8, dequantize + GEMM for float" if vnni else (
        "AVX2 vpmaddubsw for int8 (auto: Q8_0 up to 128 rows), dequantize + GEMM for float"
        if maddubs else "dequantize + GEMM")
    print(f"many-row path: {path}; "
          "ms per call (x dense bf16: the dense bf16 time over this one)")
    header = (f"{'format':<7}{'shape':>10}{'M':>6}{'int8 f32':>10}{'int8 bf16':>10}"
              f"{'float bf16':>11}{'float f32':>10}{'dense bf16':>11}{'dense f32':>10}"
              f"{'x dense bf16':>13}")
    for out_f, in_f in shapes:
        for name in formats:
            if in_f % KEPT_TYPES[name].block_elems:
                continue
            w = random_blocks(name, out_f, in_f, rng)
            wd = ql.dequantize(w, torch.bfloat16)
            print(f"\n{name} {out_f}x{in_f}: dequantize to bf16 "
                  f"{ms(lambda w=w: ql.dequantize(w, torch.bfloat16)):.3f} ms\n{header}")
            for m in rows:
                t = row_times(w, wd, torch.randn(m, in_f), kernels, ms)
                print(f"{name:<7}{f'{out_f}x{in_f}':>10}{m:6d}" + "".join(
                    f"{v:{width}.3f}" for v, width in zip(t, WIDTHS, strict=True))
                    + f"{t[4] / t[0]:13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default=",".join(KEPT_TYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--many", default="", help="rows of x, comma-separated: the many-row "
                        "path's ms per call instead")
    parser.add_argument("--shapes", default="1536x576,576x1536",
                        help="out x in, comma-separated (with --many)")
    parser.add_argument("--kernels", choices=ql.MANY_ROW_KERNELS, default="auto",
                        help="with --many: the many-row kernels (auto: as the engine chooses)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    library = build.library()
    if library is None:
        raise SystemExit(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    if args.many:
        from plugserve.kernels.cpu_malloc import keep_freed_memory

        keep_freed_memory()  # as the engine does: large outputs reuse mapped memory
        print(f"CPU kernels: {library.isa()}; {args.threads} threads")
        shapes = [(int(a), int(b)) for a, b in (s.split("x") for s in args.shapes.split(","))]
        with torch.inference_mode():
            many_rows_table([int(r) for r in args.many.split(",")], args.formats.split(","),
                            shapes, args.kernels, max(args.repeats, 20))
        return
    rng = np.random.default_rng(0)
    bandwidth = read_bandwidth(args.repeats)
    print(f"CPU kernels: {library.isa()}; {args.threads} threads; x rows {args.rows}; "
          f"read bandwidth {bandwidth:.1f} GB/s (sum of {STREAM_BYTES >> 20} MiB fp32)")
    header = f"{'weights':<10}{'shape':>12}{'MB':>8}{'GB/s':>8}{'% bw':>7}{'us':>9}{'x fp32':>8}"
    with torch.inference_mode():
        for out_f, in_f in SHAPES:
            print(f"\n{out_f}x{in_f}\n{header}")
            x32 = torch.randn(args.rows, in_f)
            dense: dict[str, torch.Tensor] = {}
            fp32_us = 0.0
            for dtype in (torch.float32, torch.bfloat16):
                w = (torch.randn(out_f, in_f) * in_f**-0.5).to(dtype)
                nbytes = w.numel() * w.element_size()
                copies = [w.clone() for _ in range(max(1, STREAM_BYTES // nbytes))]
                x = x32.to(dtype)
                dense[str(dtype)] = w
                gbs = stream_gb_s(
                    [lambda c=c, x=x: skinny_linear.skinny_linear(x, c, None) for c in copies],
                    nbytes, args.repeats)
                us = nbytes / gbs / 1e3
                fp32_us = fp32_us or us
                label = f"dense {str(dtype).removeprefix('torch.').replace('float32', 'fp32')}"
                print(f"{label:<10}{'':>12}{nbytes / 1e6:8.2f}{gbs:8.1f}"
                      f"{100 * gbs / bandwidth:6.0f}%{us:9.1f}{fp32_us / us:8.2f}")
                del copies
            for name in args.formats.split(","):
                if in_f % KEPT_TYPES[name].block_elems:
                    print(f"{name:<10}{'(n/a: ' + str(in_f) + ' columns)':>30}")
                    continue
                w = random_blocks(name, out_f, in_f, rng)
                nbytes = w.nbytes
                copies = [QuantBlocks(w.qtype, w.data.clone(), w.rows, w.cols)
                          for _ in range(max(1, STREAM_BYTES // nbytes))]
                for acts in ("int8", "float"):
                    gbs = stream_gb_s(
                        [lambda c=c, a=acts, x=x32: ql.few_rows(x, c, None, a) for c in copies],
                        nbytes, args.repeats)
                    us = nbytes / gbs / 1e3
                    print(f"{name:<10}{acts:>12}{nbytes / 1e6:8.2f}{gbs:8.1f}"
                          f"{100 * gbs / bandwidth:6.0f}%{us:9.1f}{fp32_us / us:8.2f}")
                del copies


if __name__ == "__main__":
    main()
