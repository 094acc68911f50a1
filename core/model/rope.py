"""Rotary position embedding: inverse frequencies for each scaling type and a cos/sin cache.

The cache holds cos and sin for every position up to `max_position_embeddings`, computed in
float32 once and stored in the model dtype; a forward reads the rows for
`forward_batch.positions` once and every layer reuses them. Rotation is the half-split
("neox") layout HF Llama checkpoints use: the first and second halves of a head pair up.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from plugserve.model.errors import UnsupportedArchitectureError


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, and the
    band between is blended linearly in 1/wavelength."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    original_context = float(scaling["original_max_position_embeddings"])
    longest_kept = original_context / low  # wavelengths above this are fully scaled
    shortest_scaled = original_context / high  # wavelengths below this are untouched
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > longest_kept, inv_freq / factor, inv_freq)
    blend = (original_context / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelength >= shortest_scaled) & (wavelength <= longest_kept)
    return torch.where(in_band, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Float32 inverse frequencies, one per pair of head dims ([head_dim // 2])."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":  # GGUF rope_freqs: per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise UnsupportedArchitectureError(
        f"rope_type {rope_type!r} is not supported; supported: linear, llama3, freq_factors"
    )


class RotaryEmbedding(nn.Module):
    cos_sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [positions, head_dim]
        self.register_buffer("cos_sin", cos_sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [num_tokens, 1, head_dim // 2]."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by the angles whose cos/sin are given."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
