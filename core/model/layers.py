"""Building blocks of the Llama-family decoder: linear and embedding layers, RMSNorm (also
Gemma's (1 + w) form) and the gated MLP (SwiGLU, or GELU-tanh for Gemma 3).

Parameters are allocated with `torch.empty` on the target device and never initialised: a
loader overwrites every one of them, so random initialisation would only cost time.

Half-precision matmuls on a CPU without native bf16/fp16 kernels (no AVX512-BF16/AMX) run
many times slower than float32 ones. There the weights stay in the model's dtype (and so do
the activations between layers and the KV cache), but each matmul multiplies in float32
against a float32 copy of the weight made once (`matmul_weight`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.kernels import fused_elementwise as fused
from plugserve.kernels import skinny_linear as skinny
from plugserve.kernels.packed_linear import Derived, packed, per_weight, upcasts_matmul

Device = torch.device | str

# Parameters assigned to any module so far, counted by a torch hook: a cache built from a
# model's parameter objects (not their values, which it shares) is stale once this moves.
_parameters_registered = 0


def _count_registration(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    global _parameters_registered
    _parameters_registered += 1


nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def parameter_generation() -> int:
    """A number that changes whenever a parameter is assigned to a module."""
    return _parameters_registered


_fp32_copies: dict[int, Derived] = {}


def matmul_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` itself, or its float32 copy where half-precision matmuls are slow. The copy is
    made once and refreshed when the weight is written in place (its version counter moves)."""
    if not upcasts_matmul(weight):
        return weight
    copy = per_weight(_fp32_copies, weight, lambda w: w.detach().float())
    assert isinstance(copy, torch.Tensor)
    return copy


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), returned in `out_dtype` (default x's dtype). Multiplies in
    float32 where half precision is slow (see above): for a few rows with the streaming
    kernel (`plugserve.kernels.skinny_linear`: float32, and bf16 on AVX512-BF16 CPUs),
    otherwise against a weight packed once for the CPU's GEMM library where there is one
    (`plugserve.kernels.packed_linear`)."""
    in_dtype = x.dtype
    w = matmul_weight(weight)
    if w is not weight:
        x = x.float()
        bias = None if bias is None else bias.float()
    elif x.dtype != w.dtype:
        x = x.to(w.dtype)
    # A pack is a detached copy: training (gradients wanted) multiplies the weight itself.
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    if not needs_grad and skinny.applies(x, w):
        out = skinny.skinny_linear(x, w, bias)
    else:
        pack = None if needs_grad else packed(w)
        out = pack(x, bias) if pack is not None else F.linear(x, w, bias)
    wanted = out_dtype or in_dtype
    return out if out.dtype == wanted else out.to(wanted)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight is [out_features, in_features]."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
        device: Device,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in={in_features}, out={out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    def __init__(self, num_tokens: int, size: int, *, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_tokens, size, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32, scaled by `weight`.

    Llama casts the normalised x back to the input dtype, then multiplies by `weight`. With
    `unit_offset` (Gemma) the scale is (1 + weight) and the product is taken in float32
    before the cast back. On the CPU this runs as one fused pass per row
    (`plugserve.kernels.fused_elementwise`); its torch reference is the path elsewhere.
    """

    def __init__(
        self, size: int, eps: float, *, dtype: torch.dtype, device: Device,
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.applies(x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return fused.rms_norm_reference(x, self.weight, self.eps, self.unit_offset)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x): a sub-layer's output joins the residual stream
        and the sum is normed, in one pass where the fused kernel applies."""
        if x.shape == residual.shape and fused.applies(x, residual, self.weight):
            return fused.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        total = residual + x
        return self(total), total

    def extra_repr(self) -> str:
        offset = ", 1 + weight" if self.unit_offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF `hidden_act` / `hidden_activation` name -> function (the same torch kernels HF uses).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection; act is SiLU
    (SwiGLU, the Llama family) or GELU with the tanh approximation (Gemma 3). SiLU(gate) * up
    is one fused pass on the CPU (`plugserve.kernels.fused_elementwise`)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool, dtype: torch.dtype,
        device: Device, activation: str = "silu",
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype, device=device
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=bias, dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu" and fused.applies(gate_up):
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
