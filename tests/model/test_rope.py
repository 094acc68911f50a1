"""Rope frequencies and rotation against transformers' own implementation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plugserve.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq

from .conftest import LLAMA3_ROPE


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_ROPE],
    ids=["default", "linear", "llama3"],
)
def test_inverse_frequencies_match_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rope_scaling=scaling,
    )
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "default":
        hf_inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    else:
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    ours = rope_inv_freq(16, 10000.0, scaling)
    torch.testing.assert_close(ours, hf_inv_freq, rtol=0, atol=0)
    if rope_type == "llama3":  # the test parameters reach all three bands
        ratio = ours / rope_inv_freq(16, 10000.0, None)
        assert (ratio == 1).any() and (ratio == 1 / 8).any()
        assert ((ratio > 1 / 8) & (ratio < 1)).any()


def test_rotation_matches_rotate_half_and_keeps_norms() -> None:
    rope = RotaryEmbedding(16, 64, 10000.0, None, dtype=torch.float32, device="cpu")
    positions = torch.tensor([0, 5, 63])
    x = torch.randn(3, 2, 16)
    cos, sin = rope(positions)
    out = apply_rope(x, cos, sin)
    angles = positions[:, None].float() * rope_inv_freq(16, 10000.0, None)[None, :]
    full_cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :]
    full_sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :]
    rotated_half = torch.cat((-x[..., 8:], x[..., :8]), -1)
    torch.testing.assert_close(out, x * full_cos + rotated_half * full_sin)
    torch.testing.assert_close(out[0], x[0])  # position 0 is the identity
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
