"""Dequantize-matmul: `x [M, K] @ dequant(W)[N, K].T` with W kept as its GGML blocks.

W is `plugserve.quant.QuantBlocks` data: uint8 `[N, row_bytes]`, each row its blocks one
after another, exactly as llama.cpp stores them. Supported: Q8_0 (34-byte blocks of 32:
fp16 d, 32 int8), Q4_K (144-byte super-blocks of 256: fp16 d and dmin, 12 bytes of packed
6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of 4-bit quants) and Q6_K (210-byte
super-blocks of 256: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, fp16 d).

One program computes a `[BLOCK_M, BLOCK_N]` tile of the output: for each `BLOCK_K` slice of
K it loads x's tile, widens W's bytes of that slice to fp32 in registers (each element's byte
offsets computed from its column, so any slice of whole 32-weight blocks works for every
type), rounds them to x's dtype and multiplies on the tensor cores with fp32 accumulation
(fp32 x: full-precision fp32 dot). The result is rounded to x's dtype. Nothing is
dequantized in memory: a decode step reads the blocks' bytes and nothing else.

Not wired into the model's linear layers yet; the CPU kernels (`plugserve.kernels.
quant_linear`) serve the engine. Compiled for sm_80/sm_90 by the CUDA compile check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugserve_attention_triton.kernels.launch import KernelLaunch, kernel_arch
from plugserve_attention_triton.kernels.tiles import MIN_DOT_DIM, dot_in_fp32

# Kernel codes of the GGML types this kernel reads (a constexpr: one kernel per type).
QUANT_CODES = {"q8_0": 0, "q4_k": 1, "q6_k": 2}
BLOCK_BYTES = {"q8_0": 34, "q4_k": 144, "q6_k": 210}
BLOCK_ELEMS = {"q8_0": 32, "q4_k": 256, "q6_k": 256}


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointer(s) `ptr` (0 where masked), as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    bits = (lo | (hi << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(ptr, mask):
    """The unsigned byte(s) at `ptr` (0 where masked), as int32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _int8_at(ptr, mask):
    """The signed byte(s) at `ptr` (0 where masked), as int32."""
    value = _byte_at(ptr, mask)
    return tl.where(value >= 128, value - 256, value)


@triton.jit
def _q8_0_tile(w_ptr, row_base, offs_k, valid):
    block = w_ptr + row_base[:, None] + (offs_k // 32 * 34)[None, :]
    d = _fp16_at(block, valid)
    q = _int8_at(block + 2 + (offs_k % 32)[None, :], valid)
    return d * q.to(tl.float32)


@triton.jit
def _q4_k_tile(w_ptr, row_base, offs_k, valid):
    base = w_ptr + row_base[:, None] + (offs_k // 256 * 144)[None, :]
    e = (offs_k % 256)[None, :]
    sub = e // 32  # sub-block 0..7: its 6-bit scale and min
    d = _fp16_at(base, valid)
    dmin = _fp16_at(base + 2, valid)
    scales = base + 4
    low = sub < 4
    b_sub = _byte_at(scales + sub, valid)
    b_next = _byte_at(scales + sub + 4, valid)
    b_prev = _byte_at(scales + tl.where(low, sub, sub - 4), valid)
    sc = tl.where(low, b_sub & 63, (b_next & 15) | ((b_prev >> 6) << 4))
    mn = tl.where(low, b_next & 63, (b_next >> 4) | ((b_sub >> 6) << 4))
    byte = _byte_at(base + 16 + (e // 64) * 32 + (e % 32), valid)
    nibble = tl.where(sub % 2 == 0, byte & 15, byte >> 4)
    return d * sc.to(tl.float32) * nibble.to(tl.float32) - dmin * mn.to(tl.float32)


@triton.jit
def _q6_k_tile(w_ptr, row_base, offs_k, valid):
    base = w_ptr + row_base[:, None] + (offs_k // 256 * 210)[None, :]
    e = (offs_k % 256)[None, :]
    half = e // 128
    quarter = (e % 128) // 32
    lane = e % 32
    low_byte = _byte_at(base + half * 64 + lane + 32 * (quarter % 2), valid)
    nibble = tl.where(quarter < 2, low_byte & 15, low_byte >> 4)
    high_byte = _byte_at(base + 128 + half * 32 + lane, valid)
    q = (nibble | (((high_byte >> (2 * quarter)) & 3) << 4)) - 32
    sc = _int8_at(base + 192 + half * 8 + lane // 16 + 2 * quarter, valid)
    d = _fp16_at(base + 208, valid)
    return d * (sc * q).to(tl.float32)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K,
    stride_x_row, stride_out_row, row_bytes,
    QUANT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    row_base = offs_n.to(tl.int64) * row_bytes
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_begin in range(0, K, BLOCK_K):
        offs_k = k_begin + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :],
                    other=0.0)
        valid = n_valid[:, None] & k_valid[None, :]
        if QUANT == 0:
            w = _q8_0_tile(w_ptr, row_base, offs_k, valid)
        elif QUANT == 1:
            w = _q4_k_tile(w_ptr, row_base, offs_k, valid)
        else:
            w = _q6_k_tile(w_ptr, row_base, offs_k, valid)
        w = w.to(x.dtype)
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def quant_matmul_tiles(arch: int | None, dtype: torch.dtype, rows: int) -> dict[str, int]:
    """BLOCK_M/N/K and launch options: decode-sized rows (at most 16) take a 16-row tile;
    more rows a square tile. fp32 multiplies on the FMA units: smaller tiles. Each fits the
    registers without spills (the CUDA compile check). The interpreter takes large tiles
    (fewer programs)."""
    if arch is None:
        return {"BLOCK_M": 16 if rows <= 16 else 32, "BLOCK_N": 32, "BLOCK_K": 64}
    if rows <= MIN_DOT_DIM:  # 16 x 32 x 128 spilled (Q6_K, and every fp32 type)
        k_slice = 32 if dtype == torch.float32 else 64
        tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": k_slice, "num_warps": 4}
    elif dtype == torch.float32:
        tile = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4}
    else:
        tile = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    return {**tile, "num_stages": 2}


def check_operands(x: torch.Tensor, w_data: torch.Tensor, qtype: str, n: int, k: int) -> None:
    """A ValueError naming what does not fit: the type, x's shape and dtype, W's bytes."""
    if qtype not in QUANT_CODES:
        raise ValueError(f"quant_matmul reads {', '.join(QUANT_CODES)} blocks, not {qtype!r}")
    if k % BLOCK_ELEMS[qtype]:
        raise ValueError(f"{qtype}: K={k} is not a multiple of its block of "
                         f"{BLOCK_ELEMS[qtype]} weights")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {k}] with contiguous rows, got {list(x.shape)} "
                         f"strides {list(x.stride())}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    want = (n, k // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype])
    if w_data.dtype != torch.uint8 or tuple(w_data.shape) != want or not w_data.is_contiguous():
        raise ValueError(f"{qtype} blocks of a [{n}, {k}] matrix must be contiguous uint8 "
                         f"{list(want)}, got {w_data.dtype} {list(w_data.shape)}")


def quant_matmul_launch(x: torch.Tensor, w_data: torch.Tensor, qtype: str, n: int, k: int,
                        out: torch.Tensor, *, arch: int | None) -> KernelLaunch:
    """The launch computing `out [M, n] = x [M, k] @ dequant(w_data).T` for `arch` (None:
    the CPU interpreter)."""
    check_operands(x, w_data, qtype, n, k)
    rows = x.shape[0]
    tiles = quant_matmul_tiles(arch, x.dtype, rows)
    grid = (triton.cdiv(rows, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    args = (x, w_data, out, rows, n, k, x.stride(0), out.stride(0), w_data.stride(0))
    options: dict[str, object] = {"QUANT": QUANT_CODES[qtype],
                                  "DOT_IN_FP32": dot_in_fp32(arch, x.dtype), **tiles}
    return KernelLaunch(_quant_matmul_kernel, grid, args, options)


def quant_matmul(x: torch.Tensor, w: object) -> torch.Tensor:
    """`x [..., K] @ dequant(w).T` in x's dtype, w a `plugserve.quant.QuantBlocks` of Q8_0,
    Q4_K or Q6_K on x's device."""
    qtype, data = str(w.qtype.name), w.data  # type: ignore[attr-defined]
    n, k = int(w.rows), int(w.cols)  # type: ignore[attr-defined]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    if flat.shape[0] and n:
        launch = quant_matmul_launch(flat, data.contiguous(), qtype, n, k, out,
                                     arch=kernel_arch(_quant_matmul_kernel, x.device))
        launch.run()
    return out.reshape(*x.shape[:-1], n)
