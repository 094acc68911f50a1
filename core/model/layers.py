"""Building blocks of the Llama-family decoder: linear and embedding layers, RMSNorm and the
SwiGLU MLP.

Parameters are allocated with `torch.empty` on the target device and never initialised: a
loader overwrites every one of them, so random initialisation would only cost time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Device = torch.device | str


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
        return F.linear(x, self.weight, self.bias)

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
    """Root-mean-square norm over the last dim, computed in float32, scaled by `weight`."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one projection."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool, dtype: torch.dtype,
        device: Device,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype, device=device
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=bias, dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
