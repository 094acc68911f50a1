"""ModelArchConfig from HF configs (transformers 4.x and 5.x layouts) and back."""

from __future__ import annotations

from typing import Any

import pytest

from plugserve.attention.base import AttentionLayer
from plugserve.model import ModelArchConfig, ModelLoadError, UnsupportedArchitectureError

BASE: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": [2, 5],
}


def test_llama_v4_layout_with_llama3_rope() -> None:
    arch = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
    )
    assert arch.model_type == "llama"
    assert arch.head_dim == 16 and arch.q_size == 64 and arch.kv_size == 32
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert arch.eos_token_ids == (2, 5) and arch.bos_token_id == 1
    assert not arch.attention_bias and not arch.qk_norm and not arch.tie_word_embeddings
    assert arch.layer_sliding_window == (None, None, None) and arch.sliding_window is None


def test_v5_rope_parameters_and_legacy_type_key() -> None:
    v5 = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "model_type": "llama",
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        }
    )
    assert v5.rope_theta == 1000.0 and v5.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    legacy = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "model_type": "llama",
            "rope_theta": 1000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert legacy == v5
    plain = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "model_type": "llama",
            "rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
        }
    )
    assert plain.rope_scaling is None and plain.rope_theta == 7.0


def test_qwen2_bias_and_v4_sliding_layers() -> None:
    arch = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 2,
        }
    )
    assert arch.attention_bias and not arch.attention_out_bias
    assert arch.layer_sliding_window == (None, None, 8) and arch.sliding_window == 8
    assert arch.is_hybrid_sliding_window
    assert arch.full_attention_layer_ids == [0, 1] and arch.sliding_window_layer_ids == [2]
    off = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": 8,
        }
    )
    assert off.layer_sliding_window == (None, None, None)


def test_qwen3_norms_and_mistral_window() -> None:
    qwen3 = ModelArchConfig.from_hf_config({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128
    mistral = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 16,
            "head_dim": None,
        }
    )
    assert mistral.model_type == "mistral" and mistral.head_dim == 16
    assert mistral.layer_sliding_window == (16, 16, 16) and not mistral.is_hybrid_sliding_window


def test_attention_layers() -> None:
    arch = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        }
    )
    layers = arch.attention_layers()
    assert layers == [
        AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25),
        AttentionLayer(
            layer_id=1, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, sliding_window=8
        ),
        AttentionLayer(
            layer_id=2, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25, sliding_window=8
        ),
    ]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_hf_config_round_trip(model_type: str) -> None:
    extra: dict[str, Any] = {"model_type": model_type}
    if model_type == "qwen2":
        extra.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if model_type == "llama":
        extra.update(rope_scaling={"rope_type": "linear", "factor": 4.0}, attention_bias=True)
    arch = ModelArchConfig.from_hf_config({**BASE, **extra})
    assert ModelArchConfig.from_hf_config(arch.to_hf_config()) == arch


def test_unsupported_architecture_names_it_and_the_supported_list() -> None:
    with pytest.raises(UnsupportedArchitectureError) as err:
        ModelArchConfig.from_hf_config(
            {**BASE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
        )
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in message
    with pytest.raises(UnsupportedArchitectureError, match="'phi3'"):
        ModelArchConfig.from_hf_config({**BASE, "model_type": "phi3"})


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": None}, "'hidden_size'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ],
)
def test_bad_configs_say_what_is_wrong(change: dict[str, Any], expected: str) -> None:
    with pytest.raises(ModelLoadError, match=expected):
        ModelArchConfig.from_hf_config({**BASE, "model_type": "llama", **change})
