"""Which layers are windowed, read exactly as transformers reads it; bad window configs.

The expected windows come from transformers itself: each case builds the model from
transformers' config class (so its defaults for absent keys apply) and reads every layer's
window the way its modeling code uses it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import (
    ModelArchConfig,
    ModelLoadError,
    UnsupportedArchitectureError,
    load_model,
)
from plugserve.testing.tiny_models import SLIDING_WINDOW_ARCHITECTURES, make_tiny_model_dir

LAYERS = 30  # more than Qwen's default max_window_layers (28)
BASE: dict[str, Any] = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}
HYBRID_TYPES = ["sliding_attention", "full_attention", "sliding_attention"] * 10
CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def _transformers_windows(model_type: str, config: dict[str, Any]) -> tuple[int | None, ...]:
    import transformers

    config_name, model_name = CLASSES[model_type]
    hf_config = getattr(transformers, config_name)(**config)
    model = getattr(transformers, model_name)(hf_config)
    if model_type == "mistral":  # MistralAttention passes config.sliding_window to every layer
        return (hf_config.sliding_window,) * hf_config.num_hidden_layers
    return tuple(layer.self_attn.sliding_window for layer in model.model.layers)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}),  # max_window_layers 28
        ("qwen2", {"use_sliding_window": True}),  # sliding_window defaults to 4096
        ("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}),
        ("qwen2", {"sliding_window": 8, "max_window_layers": 0}),  # use_sliding_window false
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "layer_types": HYBRID_TYPES}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 29}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
                   "layer_types": ["full_attention"] * LAYERS}),
        ("mistral", {"sliding_window": 8}),
        ("mistral", {}),  # sliding_window defaults to 4096
        ("mistral", {"sliding_window": None}),
        ("mistral", {"sliding_window": 8, "layer_types": HYBRID_TYPES}),  # ignored
    ],
)
def test_layer_windows_match_transformers(model_type: str, extra: dict[str, Any]) -> None:
    config = {**BASE, **extra}
    arch = ModelArchConfig.from_hf_config({**config, "model_type": model_type})
    expected = _transformers_windows(model_type, config)
    assert arch.layer_sliding_window == expected
    used = {w for w in expected if w is not None}
    assert arch.sliding_window == (used.pop() if used else None)
    assert all(layer.sliding_window == w for layer, w in
               zip(arch.attention_layers(), expected, strict=True))


def test_mistral_layer_types_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="plugserve.model.sliding_window"):
        ModelArchConfig.from_hf_config(
            {**BASE, "model_type": "mistral", "sliding_window": 8, "layer_types": HYBRID_TYPES}
        )
    assert "layer_types: ignored" in caplog.text


# ---- bad input, at load time ----------------------------------------------------------------


@pytest.fixture(scope="module")
def swa_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("swa_cfg")
    return {
        arch: make_tiny_model_dir(root / arch, arch=arch, seed=0)
        for arch in SLIDING_WINDOW_ARCHITECTURES
    }


def _edited(folders: dict[str, Path], arch: str, tmp_path: Path, **changes: Any) -> Path:
    folder = tmp_path / arch
    shutil.copytree(folders[arch], folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("arch", "changes", "expected"),
    [
        ("qwen3_swa", {"layer_types": ["sliding_attention", "full_attention"]},
         r"layer_types has 2 entries, expected one per layer \(num_hidden_layers = 3\)"),
        ("gemma3", {"layer_types": ["sliding_attention"] * 7},
         r"layer_types has 7 entries, expected one per layer \(num_hidden_layers = 6\)"),
        ("qwen3_swa", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
         r"layer types \['chunked_attention'\] are not supported; supported: full_attention, "
         r"sliding_attention"),
        ("gemma3", {"layer_types": ["local"] * 5 + ["full_attention"]},
         r"layer types \['local'\] are not supported; supported: full_attention"),
        ("qwen3_swa", {"layer_types": "sliding_attention"},
         "layer_types must be a list of layer type names, got 'sliding_attention'"),
        ("qwen3_swa", {"use_sliding_window": False},
         r"names sliding_attention layers \(layer 0\) but no sliding window is in effect"),
        ("qwen2_swa", {"sliding_window": 0},
         r"sliding_window must be a positive integer number of tokens \(or null for no "
         r"window\), got 0"),
        ("mistral_swa", {"sliding_window": -16}, "sliding_window must be a positive .* got -16"),
        ("gemma3", {"sliding_window": 0}, "sliding_window must be a positive .* got 0"),
        ("qwen2_swa", {"sliding_window": "24"}, "sliding_window must be a positive .* got '24'"),
        ("qwen2_swa", {"sliding_window": 16.5}, "sliding_window must be a positive .* got 16.5"),
        ("qwen2_swa", {"layer_types": None, "max_window_layers": -1},
         "max_window_layers must be a non-negative integer .* got -1"),
    ],
)
def test_bad_window_configs_fail_at_load_with_one_clear_error(
    swa_folders: dict[str, Path], tmp_path: Path, arch: str, changes: dict[str, Any],
    expected: str,
) -> None:
    folder = _edited(swa_folders, arch, tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=expected) as err:
        load_model(str(folder), dtype=torch.float32, device="cpu")
    assert str(folder / "config.json") in str(err.value)


def test_unknown_layer_type_is_an_unsupported_architecture() -> None:
    with pytest.raises(UnsupportedArchitectureError):
        ModelArchConfig.from_hf_config(
            {**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
             "layer_types": ["mamba"] * LAYERS}
        )


def test_arch_refuses_a_non_positive_window() -> None:
    arch = ModelArchConfig.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 8})
    with pytest.raises(ModelLoadError, match="a sliding window must be a positive number of "
                                             "tokens, got 0"):
        ModelArchConfig(**{**arch.__dict__, "layer_sliding_window": (0,) * LAYERS})


def test_gguf_window_must_be_positive() -> None:
    metadata = {
        "general.architecture": "llama", "llama.embedding_length": 16,
        "llama.attention.head_count": 2, "llama.block_count": 2,
        "llama.feed_forward_length": 16, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 64, "llama.vocab_size": 32, "llama.attention.sliding_window": 0,
    }
    with pytest.raises(ModelLoadError, match=r"llama\.attention\.sliding_window must be a "
                                             r"positive integer .* got 0"):
        ModelArchConfig.from_gguf_metadata(metadata, tensor_names=[])
