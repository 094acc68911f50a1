"""Speculative decoding: the protocol a spec plugin implements, and its allocation rules."""

from __future__ import annotations

from plugserve.spec.alloc import alloc_len_per_decode, extra_row_width
from plugserve.spec.base import SpecAlgorithm, SpecContext, SpecDecodeOutput

__all__ = [
    "SpecAlgorithm",
    "SpecContext",
    "SpecDecodeOutput",
    "alloc_len_per_decode",
    "extra_row_width",
]
