"""Benchmarks shipped with the package (`plugserve bench`)."""

from __future__ import annotations
