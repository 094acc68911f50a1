"""Which layers of a model attend through a sliding window, read from an HF config.

This follows transformers 5.23's config classes and models exactly, including their
defaults for keys a config.json leaves out:

- Llama: no windows.
- Mistral: every layer has the window `sliding_window` (default 4096), or none when it is
  null; `layer_types` is ignored, as MistralForCausalLM ignores it (a warning is logged).
- Qwen2 / Qwen3: no window unless `use_sliding_window` (default false); then `layer_types`
  if given, else layers i >= `max_window_layers` (default 28) are windowed, all with the
  window `sliding_window` (default 4096).
- Gemma 3 (`plugserve.model.gemma3_config`): `layer_types` if given, else every
  `sliding_window_pattern`-th layer (default 6) is global and the others have the window
  `sliding_window` (default 4096).

A window follows transformers' mask: a query at position p sees keys at positions
p - window < k <= p, i.e. `window` tokens including itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from numbers import Integral
from typing import Any

from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError

logger = logging.getLogger(__name__)

LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' defaults for the sliding-window keys a config.json may leave out.
DEFAULT_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28


def window_value(value: Any, key: str = "sliding_window") -> int | None:
    """A sliding window read from a config: None, or a positive number of tokens."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ModelLoadError(
            f"{key} must be a positive integer number of tokens (or null for no window), "
            f"got {value!r}"
        )
    return int(value)


def windows_from_layer_types(
    layer_types: Any, window: int | None, num_layers: int
) -> tuple[int | None, ...]:
    """Per-layer windows from an HF `layer_types` list, validated."""
    if not isinstance(layer_types, list | tuple) or not all(
        isinstance(t, str) for t in layer_types
    ):
        raise ModelLoadError(f"layer_types must be a list of layer type names, got {layer_types!r}")
    if len(layer_types) != num_layers:
        raise ModelLoadError(
            f"layer_types has {len(layer_types)} entries, expected one per layer "
            f"(num_hidden_layers = {num_layers})"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedArchitectureError(
            f"layer types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}"
        )
    if "sliding_attention" in layer_types and window is None:
        raise ModelLoadError(
            f"layer_types names sliding_attention layers (layer "
            f"{layer_types.index('sliding_attention')}) but no sliding window is in effect "
            "(sliding_window is null, or use_sliding_window is false)"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def layer_windows_from_hf(
    config: Mapping[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, ...]:
    """The sliding window of every layer (None = full attention), as transformers reads it."""
    if model_type == "llama":
        return (None,) * num_layers
    if model_type == "mistral":
        window = window_value(config.get("sliding_window", DEFAULT_WINDOW))
        if config.get("layer_types") is not None:
            logger.warning(
                "MistralForCausalLM config has layer_types: ignored (as transformers does); "
                "every layer uses sliding_window=%s", window,
            )
        return (window,) * num_layers
    # qwen2 / qwen3
    if not config.get("use_sliding_window", False):
        window = None
    else:
        window = window_value(config.get("sliding_window", DEFAULT_WINDOW))
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return windows_from_layer_types(layer_types, window, num_layers)
    if window is None:
        return (None,) * num_layers
    first_sliding = config.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
    if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
        raise ModelLoadError(
            f"max_window_layers must be a non-negative integer (the first windowed layer), "
            f"got {first_sliding!r}"
        )
    return tuple(window if i >= first_sliding else None for i in range(num_layers))


def gemma3_layer_windows(config: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Gemma 3: `layer_types`, else layer i is global when (i + 1) % sliding_window_pattern
    == 0 (5 local : 1 global by default) and local layers have the window."""
    window = window_value(config.get("sliding_window", DEFAULT_WINDOW))
    layer_types = config.get("layer_types")
    if layer_types is None:
        pattern = config.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelLoadError(
                f"sliding_window_pattern must be a positive integer (every n-th layer is "
                f"global), got {pattern!r}"
            )
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    return windows_from_layer_types(layer_types, window, num_layers)
