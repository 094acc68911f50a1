"""Causal prefill attention for one sequence: the compiled CPU kernel and its reference.

`q` [E, H, D] holds the sequence's E new tokens and `k`, `v` [S, KVH, D] its whole K/V with
the prefix first (S = prefix_len + E). Query i sits at position prefix_len + i and attends to
the keys at positions 0 ..= prefix_len + i, or with a sliding `window` only to those in
(prefix_len + i - window, prefix_len + i]. Query head h uses kv head h // (H // KVH).

`reference` is `scaled_dot_product_attention` in float32 with that mask spelled out as a
boolean tensor; `prefill_attention` runs `csrc/kernels/prefill_attention.cpp`, a flash-attention
style loop (online softmax in float32 over blocks of keys, the fully masked blocks skipped)
that is tested against it (tests/kernels/test_prefill_attention.py). In bf16 on a CPU with
AMX (`amx_applies`) it runs `csrc/kernels/prefill_attention_amx.cpp` instead: the same loop
with both products on the AMX tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugserve.kernels import build, dense_amx
from plugserve.kernels import isa as cpu_isa

AMX_HEAD_DIM_MULTIPLE = 32  # the AMX kernel's head_dim: whole 32-value tile rows

# The ISA copies whose vector code beats SDPA (the scalar one runs ATen's generic vectors,
# correct but slower than SDPA).
VECTOR_ISAS = frozenset({"avx2", "avx512", "avx512_vnni", "avx512_bf16", "neon", "sve256"})


def available() -> bool:
    """True when the compiled kernel loads on this machine (compiling it the first time)."""
    return build.library() is not None


def why_unavailable() -> str | None:
    return build.unavailable_reason()


def isa() -> str:
    """The vector code the kernel runs: the ISA copy in use ("avx512_bf16", "avx512_vnni",
    "avx512", "avx2", "neon", "sve256"), or "none" for the scalar copy. For head_dim % 16 == 0 the
    vector copies are 1.8-3x faster than SDPA on a 2-core Zen 4; with "none" (or another
    head_dim) the kernel runs plain loops, correct but slower than SDPA, so a caller should
    keep SDPA there. (Where `amx_applies`, bf16 runs the AMX kernel instead.)"""
    library = build.library()
    if library is None:
        raise RuntimeError(f"the prefill_attention CPU kernel is unavailable: {why_unavailable()}")
    return library.isa() if library.isa() in VECTOR_ISAS else "none"


def amx_applies(dtype: torch.dtype, head_dim: int) -> bool:
    """True when `prefill_attention` runs the AMX kernel for this dtype and head_dim: bf16,
    head_dim a multiple of 32, and the kernels' copy in use runs AMX here
    (`dense_amx.amx_usable`: the CPU has AMX-BF16, the OS grants the tiles)."""
    return (
        dtype == torch.bfloat16 and head_dim % AMX_HEAD_DIM_MULTIPLE == 0 and head_dim > 0
        and available() and dense_amx.amx_usable()
    )


def sdpa_is_faster(dtype: torch.dtype, head_dim: int) -> bool:
    """True where torch's `scaled_dot_product_attention` beats these kernels: bf16 (fp16) on
    a CPU with AMX-BF16 (AMX-FP16), where torch's flash attention multiplies its
    half-precision blocks on the AMX tiles, unless the AMX kernel runs (`amx_applies`: bf16,
    head_dim % 32 == 0). Measured on a 2-core Xeon with AMX, bf16, 9 query / 3 KV heads of
    64, causal, per layer (benchmarks/prefill_attention_speed.py, four runs): SDPA 2.52-2.82
    ms against the float32-vector kernel's 6.9-7.1 and the AMX kernel's 1.51-1.99 at 1,024
    tokens, 0.79-0.91 / 1.9 / 0.45-0.56 at 512, 0.15-0.17 / 0.21 / 0.08 at 150; with a
    512-token cached prefix (SDPA then needs a boolean mask) 6.58 / 13.1 / 3.03 at 1,024."""
    flag = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}.get(dtype)
    return flag is not None and cpu_isa.has_cpu_flag(flag) and not amx_applies(dtype, head_dim)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix_len: int,
    window: int | None = None, *, amx: bool = True,
) -> torch.Tensor:
    """softmax(q k^T * scale, causal from `prefix_len`, within `window`) v: [E, H, D] in q's
    dtype, for q [E, H, D] and k, v [prefix_len + E, KVH, D] (float32, bfloat16 or float16;
    k and v may be strided views with a contiguous last dim). Runs the AMX kernel where
    `amx_applies` (amx=False: the vector kernel even there)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (or None), got {window}")
    ops = build.ops()
    # The kernels take 0 for "no window".
    if amx and q.ndim == 3 and amx_applies(q.dtype, q.shape[-1]):
        out: torch.Tensor = ops.prefill_attention_amx(q, k, v, scale, prefix_len, window or 0)
    else:
        out = ops.prefill_attention(q, k, v, scale, prefix_len, window or 0)
    return out


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix_len: int,
    window: int | None = None,
) -> torch.Tensor:
    """What `prefill_attention` computes: SDPA in float32 with an explicit boolean mask."""
    tokens, heads = q.shape[0], q.shape[1]
    kv_heads = k.shape[1]
    q_pos = prefix_len + torch.arange(tokens, device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=visible, scale=scale, enable_gqa=heads != kv_heads,
    )
    return out.transpose(0, 1).to(q.dtype)
