"""Speculative decoding: the protocol a spec plugin implements and its KV footprint."""

from __future__ import annotations

from plugserve.spec.base import SpecAlgorithm, SpecContext, SpecDecodeOutput
from plugserve.structs.spec_footprint import SpecFootprint

__all__ = ["SpecAlgorithm", "SpecContext", "SpecDecodeOutput", "SpecFootprint"]
