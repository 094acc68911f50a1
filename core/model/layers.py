"""Building blocks of the Llama-family decoder: linear and embedding layers, RMSNorm (also
Gemma's (1 + w) form) and the gated MLP (SwiGLU, or GELU-tanh for Gemma 3).

Parameters are allocated with `torch.empty` on the target device and never initialised: a
loader overwrites every one of them, so random initialisation would only cost time.

Half-precision matmuls on a CPU without native bf16/fp16 kernels (no AVX512-BF16/AMX) run
many times slower than float32 ones in the GEMM libraries. There the weights stay in the
model's dtype and are read as such (half the bytes of float32, no float32 copy is kept): the
CPU kernels widen them to float32 in registers and multiply in float32
(`plugserve.kernels.skinny_linear` for a few rows, `plugserve.kernels.widening_gemm` for
more). Without the kernels (`PLUGSERVE_CPU_KERNELS=0`, no compiler) each such matmul
multiplies in float32 against a float32 copy of the weight made for that call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.kernels import dense_amx
from plugserve.kernels import fused_elementwise as fused
from plugserve.kernels import panel_gemm as panel
from plugserve.kernels import skinny_linear as skinny
from plugserve.kernels import widening_gemm as widening
from plugserve.kernels.packed_linear import packed, upcasts_matmul
from plugserve.model.quant_weight import LinearWeight, WeightHolder, linear_any
from plugserve.quant.reference import Activations

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


def multiplies_as_stored(weight: torch.Tensor) -> bool:
    """True when `linear` reads `weight` in its own dtype (always with the CPU kernels; in
    half precision without them only where the CPU has native half dot products)."""
    return not upcasts_matmul(weight) or widening.takes(weight)


def linear(
    x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None, activations: Activations = "int8",
) -> torch.Tensor:
    """x @ weight.T (+ bias), returned in `out_dtype` (default x's dtype). A quantized weight
    (`plugserve.model.quant_weight`) goes to the quantized matmul with `activations`."""
    return linear_any(_dense_linear, x, weight, bias, out_dtype, activations)


def _dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), returned in `out_dtype` (default x's dtype). For a few rows the
    streaming kernel (`plugserve.kernels.skinny_linear`: float32 and bf16); for a few dozen
    float32 rows the kernel that streams the weight while it multiplies
    (`plugserve.kernels.panel_gemm`), and for a decode batch's rows in bf16 on AMX the AMX
    kernel (`plugserve.kernels.dense_amx`, also for a prefill's rows where the weight is
    small); for more, a weight
    packed once for the CPU's GEMM library where it multiplies the dtype natively
    (`plugserve.kernels.packed_linear`), or the kernel that reads half-precision weights as
    they are where it does not (`plugserve.kernels.widening_gemm`)."""
    in_dtype = x.dtype
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    # A pack is a detached copy: training (gradients wanted) multiplies the weight itself.
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if needs_grad:
        out = F.linear(x, weight, bias)
    elif skinny.applies(x, weight):
        out = skinny.skinny_linear(x, weight, bias)
    elif panel.applies(x, weight):
        out = panel.panel_gemm(x, weight, bias)
    elif dense_amx.applies(x, weight) or dense_amx.applies_many(x, weight):
        out = dense_amx.dense_amx_linear(x, weight, bias)
    elif widening.applies(x, weight):
        out = widening.widening_gemm(x, weight, bias)
    else:
        pack = packed(weight)
        if pack is not None:
            out = pack(x, bias)
        elif upcasts_matmul(weight):  # no kernels: float32 for this call only
            out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        else:
            out = F.linear(x, weight, bias)
    wanted = out_dtype or in_dtype
    return out if out.dtype == wanted else out.to(wanted)


class Linear(WeightHolder):
    """y = x @ weight.T (+ bias); weight is [out_features, in_features], dense or quantized."""

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
        return linear(x, self.matrix, self.bias, activations=self.quant_activations)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        quant = "" if self.quant is None else ", " + "+".join(p.qtype.name for p in self.quant)
        return f"in={in_features}, out={out_features}, bias={self.bias is not None}{quant}"


class Embedding(WeightHolder):
    """Token embeddings; a quantized table dequantizes only the rows looked up."""

    def __init__(self, num_tokens: int, size: int, *, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_tokens, size, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup_rows(ids)


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
