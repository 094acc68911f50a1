"""Draft heads shipped with the plugin."""

from __future__ import annotations

from pathlib import Path

DEFAULT_HEAD = "smollm2-135m-instruct"


def default_head_dir() -> Path:
    """The EAGLE head trained for the built-in default model (SmolLM2-135M-Instruct); see
    TRAINING.md for how it was made."""
    return Path(__file__).parent / DEFAULT_HEAD
