"""Compile every kernel variant for CUDA targets without a GPU; print one JSON line each.

Run as a script in a process without TRITON_INTERPRET (see test_triton_cuda_compile.py). It
uses the launchers' own tile choices, so what compiles here is what a GPU would run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from plugserve_attention_triton.kernels import decode, extend
from plugserve_attention_triton.kernels.tiles import (
    MIN_DOT_DIM,
    decode_head_tile,
    decode_key_tile,
    extend_tiles,
    pow2_at_least,
)

CUDA = torch.device("cuda")


def signature(fn: object, pointers: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:  # type: ignore[attr-defined]
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name == "qk_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(fn: object, pointers: dict[str, str], constexprs: dict[str, object],
                target: GPUTarget, label: str) -> None:
    src = ASTSource(fn=fn, signature=signature(fn, pointers, constexprs), constexprs=constexprs)
    try:
        kernel = triton.compile(src, target=target)
        print(json.dumps({"kernel": label, "arch": target.arch, "ok": True,
                          "shared": kernel.metadata.shared}))
    except Exception as exc:  # report every failure, keep going
        print(json.dumps({"kernel": label, "arch": target.arch, "ok": False,
                          "error": f"{type(exc).__name__}: {exc}"[:2000]}))


EXTEND_INDEX_POINTERS = ("qo_indptr_ptr", "kv_indptr_ptr", "kv_indices_ptr",
                         "first_query_pos_ptr", "mask_indptr_ptr")

# (arch, dtype, head_dim, variant): shared memory peaks at fp32 and the widest heads on the
# smallest budget (sm_80); sm_90 checks that the same code builds for Hopper. A compile takes
# seconds on a small machine, so the list is short.
EXTEND_CASES = [
    (80, "fp32", 128, (True, True)), (80, "fp32", 256, (True, True)),
    (80, "bf16", 256, (True, False)), (80, "fp16", 64, (False, False)),
    (90, "bf16", 128, (False, True)),
]
DECODE_CASES = [
    (80, "fp32", 128, 4), (80, "fp32", 256, 1), (80, "bf16", 64, 20), (90, "bf16", 128, 4),
]
REDUCE_CASES = [(80, "fp32", 256), (90, "bf16", 128)]


def main() -> None:
    for arch, dtype, head_dim, (has_mask, window) in EXTEND_CASES:
        block_d = pow2_at_least(head_dim, MIN_DOT_DIM)
        block_m, block_n = extend_tiles(CUDA, block_d)
        pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        pointers.update({name: "*i64" for name in EXTEND_INDEX_POINTERS}, mask_ptr="*u8")
        compile_one(extend._extend_kernel, pointers,
                    {"HAS_MASK": has_mask, "HAS_WINDOW": window, "BLOCK_M": block_m,
                     "BLOCK_N": block_n, "BLOCK_D": block_d},
                    GPUTarget("cuda", arch, 32),
                    f"extend {dtype} d={head_dim} mask={has_mask} window={window}")
    for arch, dtype, head_dim, group in DECODE_CASES:
        block_d = pow2_at_least(head_dim, MIN_DOT_DIM)
        pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr")}
        pointers.update(partial_out_ptr="*fp32", partial_lse_ptr="*fp32",
                        kv_indptr_ptr="*i64", kv_indices_ptr="*i64", num_kv_splits_ptr="*i32")
        compile_one(decode._decode_partial_kernel, pointers,
                    {"HAS_WINDOW": group == 4, "BLOCK_H": decode_head_tile(group),
                     "BLOCK_N": decode_key_tile(CUDA, block_d), "BLOCK_D": block_d},
                    GPUTarget("cuda", arch, 32), f"decode {dtype} d={head_dim} group={group}")
    for arch, dtype, head_dim in REDUCE_CASES:
        block_d = pow2_at_least(head_dim, MIN_DOT_DIM)
        compile_one(decode._decode_reduce_kernel,
                    {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                     "o_ptr": f"*{dtype}", "num_kv_splits_ptr": "*i32"},
                    {"BLOCK_S": 8, "BLOCK_D": block_d},
                    GPUTarget("cuda", arch, 32), f"reduce {dtype} d={head_dim}")


if __name__ == "__main__":
    main()
