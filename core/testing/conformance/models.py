"""Tiny model folders the engine-level suite needs beyond `tiny_model_dir`, built once per
test session under its temporary root."""

from __future__ import annotations

import functools
from pathlib import Path

SLIDING_WINDOW = 8


@functools.cache
def sliding_window_model_dir(root: str) -> Path:
    """A tiny Mistral whose every layer attends to the last `SLIDING_WINDOW` tokens."""
    from plugserve.testing.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(Path(root) / "conformance_mistral_swa", arch="mistral", seed=1,
                               sliding_window=SLIDING_WINDOW)


@functools.cache
def eagle_head_dir(target_dir: str, root: str) -> Path:
    """A trained tiny EAGLE head for `target_dir` (it accepts drafts, so verified tree
    nodes past the root decide tokens). Needs the eagle plugin."""
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    return make_tiny_head_dir(target_dir, Path(root) / "conformance_eagle_head", trained=True)
