"""Errors raised while reading a model's configuration, weights or tokenizer."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded: the message names the path and what is wrong with it."""


class UnsupportedArchitectureError(ModelLoadError):
    """The configuration asks for an architecture or feature this engine does not implement."""
