"""The decoder's elementwise steps fused into one pass each: the compiled CPU kernels and their
torch references.

`rms_norm` is RMSNorm over the last dim (the Llama form, or Gemma's (1 + w) one with
`unit_offset`), `add_rms_norm` adds a sub-layer's output to the residual stream and norms the
sum, `silu_mul` is SwiGLU's SiLU(gate) * up over the two halves of the gate-up projection,
and `rope_` rotates the q and k heads in place, where the qkv projection left them (its
reference is `plugserve.model.rope.apply_rope`). The references are the torch code the
layers ran before the kernels, and remain their path wherever `applies` says no;
`csrc/kernels/elementwise.cpp` computes the same in one pass over each row, rounding to the
input dtype where the references round (the kernel is tested against them,
tests/kernels/test_fused_elementwise.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from plugserve.kernels import build

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """True when the compiled kernels load on this machine (compiling them the first time)."""
    return build.library() is not None


def why_unavailable() -> str | None:
    return build.unavailable_reason()


def applies(*tensors: torch.Tensor) -> bool:
    """True when the kernels should take these operands: CPU tensors of one supported dtype,
    no gradient wanted through them, and the kernels built here. Otherwise use the reference."""
    # Called for every norm and MLP of every layer: cheap attribute checks only.
    first = tensors[0]
    dtype = first.dtype
    if not first.is_cpu or dtype not in DTYPES or first.ndim == 0:
        return False
    for t in tensors[1:]:
        if not t.is_cpu or t.dtype != dtype:
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return build.library() is not None


def _module() -> Any:
    return build.ops()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled by `weight` ([x.shape[-1]], x's dtype)."""
    out: torch.Tensor = _module().rms_norm(x, weight, eps, unit_offset)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x and residual of one shape and dtype."""
    module = _module()
    normed, total = module.add_rms_norm(x, residual, weight, eps, unit_offset)
    return normed, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up where gate and up are the first and second half of the last dim."""
    out: torch.Tensor = _module().silu_mul(gate_up)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [tokens, heads, head_dim] in place by the per-token angles whose cos and sin
    ([tokens, 1, head_dim // 2] or [tokens, head_dim // 2], x's dtype) are given. x may be a
    strided view (the q and k heads inside a fused qkv output); its head_dim is contiguous."""
    _module().rope_(x, cos, sin)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """In float32; Llama casts the normalised x back to x's dtype before the multiply by
    `weight`, Gemma (`unit_offset`) multiplies by (1 + weight) in float32 and casts after."""
    in_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(in_dtype)
    return weight * x32.to(in_dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    total = residual + x
    return rms_norm_reference(total, weight, eps, unit_offset), total


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
