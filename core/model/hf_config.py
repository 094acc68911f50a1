"""Reading and writing HF `config.json` dicts for the Llama-family architectures we run.

Both the transformers 4.x layout (`rope_theta` + `rope_scaling`, `use_sliding_window` +
`max_window_layers`) and the 5.x layout (`rope_parameters`, `layer_types`) are understood.
Which layers are windowed: `plugserve.model.sliding_window`; Gemma 3's fields:
`plugserve.model.gemma3_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError
from plugserve.model.sliding_window import layer_windows_from_hf

# HF architecture class name -> our model_type.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
}
ARCHITECTURE_OF_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
# Our model_type -> HF's `model_type`, where they differ.
HF_MODEL_TYPE = {"gemma3": "gemma3_text"}
_OUR_MODEL_TYPE = {HF_MODEL_TYPE.get(t, t): t for t in ARCHITECTURE_OF_MODEL_TYPE}

# rope_type -> the parameters it needs.
SUPPORTED_ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def model_type_of(config: Mapping[str, Any]) -> str:
    """Our model_type for an HF config, or UnsupportedArchitectureError naming what was found."""
    architectures = config.get("architectures") or []
    hf_model_type = config.get("model_type")
    if architectures:
        name = architectures[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {name!r} (model_type {hf_model_type!r}) is not supported; "
                f"supported architectures: {_supported_list()}"
            )
        return SUPPORTED_ARCHITECTURES[name]
    if hf_model_type in _OUR_MODEL_TYPE:
        return _OUR_MODEL_TYPE[str(hf_model_type)]
    raise UnsupportedArchitectureError(
        f"model_type {hf_model_type!r} (no 'architectures' entry) is not supported; "
        f"supported architectures: {_supported_list()}"
    )


def required(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ModelLoadError(f"config lacks the required field {key!r}")
    return config[key]


def id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_from_hf(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config layout, validated."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta", 10000.0)
        raw = config.get("rope_scaling")
        scaling = dict(raw) if raw else None
    if not scaling:
        return float(theta), None
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported; supported rope types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor {factor} is not supported; only 1.0 (rope on the whole head)"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = required(config, "max_position_embeddings")
    missing = [k for k in SUPPORTED_ROPE_TYPES[rope_type] if scaling.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope scaling {rope_type!r} lacks the parameter(s) {missing}")
    kept = {k: scaling[k] for k in SUPPORTED_ROPE_TYPES[rope_type]}
    return float(theta), {"rope_type": rope_type, **kept}


def arch_from_hf_config(config: Mapping[str, Any]) -> ModelArchConfig:
    model_type = model_type_of(config)
    if model_type == "gemma3":
        from plugserve.model.gemma3_config import gemma3_arch_from_hf

        return gemma3_arch_from_hf(config)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(
            f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU MLP)"
        )
    hidden = int(required(config, "hidden_size"))
    heads = int(required(config, "num_attention_heads"))
    num_layers = int(required(config, "num_hidden_layers"))
    rope_theta, rope_scaling = rope_from_hf(config)
    windows = layer_windows_from_hf(config, model_type, num_layers)
    used_windows = {w for w in windows if w is not None}
    if len(used_windows) > 1:
        raise UnsupportedArchitectureError(f"layers use different sliding windows {used_windows}")
    bias = bool(config.get("attention_bias", False))
    return ModelArchConfig(
        model_type=model_type,
        vocab_size=int(required(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required(config, "intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bias,
        attention_out_bias=False if model_type == "qwen2" else bias,
        mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        sliding_window=next(iter(used_windows), None),
        layer_sliding_window=windows,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=id_tuple(config.get("eos_token_id")),
    )


# ModelArchConfig fields only Gemma 3 sets, with the value every other family has.
GEMMA_ONLY_FIELDS: dict[str, Any] = {
    "hidden_act": "silu", "norm_unit_offset": False, "sandwich_norms": False,
    "embedding_scale": 1.0, "query_pre_attn_scalar": None, "final_logit_softcapping": None,
    "local_rope_theta": None, "local_rope_scaling": None,
}


def _check_expressible(arch: ModelArchConfig) -> None:
    gemma_only = [f"{k}={getattr(arch, k)!r}" for k, v in GEMMA_ONLY_FIELDS.items()
                  if getattr(arch, k) != v]
    if gemma_only:
        raise ModelLoadError(
            f"a {arch.model_type} HF config cannot express {', '.join(gemma_only)}"
        )
    if arch.model_type == "qwen2":
        ok = arch.attention_bias and not arch.attention_out_bias
        allowed = "q/k/v bias without output bias"
    else:
        ok = arch.attention_bias == arch.attention_out_bias
        allowed = "both or neither"
    if not ok:
        raise ModelLoadError(
            f"a {arch.model_type} HF config cannot express q/k/v bias={arch.attention_bias} "
            f"with output bias={arch.attention_out_bias} (allowed: {allowed})"
        )
    if arch.rope_scaling and arch.rope_scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope type {arch.rope_scaling['rope_type']!r} has no HF config equivalent"
        )
    if arch.qk_norm != (arch.model_type == "qwen3"):
        raise ModelLoadError(f"a {arch.model_type} HF config cannot express qk_norm={arch.qk_norm}")


def _sliding_fields(arch: ModelArchConfig) -> dict[str, Any]:
    windows = arch.layer_sliding_window
    if arch.sliding_window is None:
        return {"sliding_window": None} if arch.model_type != "llama" else {}
    if arch.model_type == "llama":
        raise ModelLoadError("a llama HF config cannot express sliding-window layers")
    if arch.model_type == "mistral":
        if any(w is None for w in windows):
            raise ModelLoadError("a mistral HF config cannot mix full and sliding layers")
        return {"sliding_window": arch.sliding_window}
    first = arch.sliding_window_layer_ids[0]
    return {
        "sliding_window": arch.sliding_window,
        "use_sliding_window": True,
        "max_window_layers": first,
        "layer_types": [
            "full_attention" if w is None else "sliding_attention" for w in windows
        ],
    }


def arch_to_hf_config(arch: ModelArchConfig) -> dict[str, Any]:
    if arch.model_type == "gemma3":
        from plugserve.model.gemma3_config import gemma3_arch_to_hf

        return gemma3_arch_to_hf(arch)
    _check_expressible(arch)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE_OF_MODEL_TYPE[arch.model_type]],
        "model_type": arch.model_type,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": dict(arch.rope_scaling) if arch.rope_scaling else None,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": (
            arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1 else list(arch.eos_token_ids)
        ),
        "torch_dtype": "float32",
    }
    if arch.model_type != "qwen2":
        config["attention_bias"] = arch.attention_bias
    if arch.model_type == "llama":
        config["mlp_bias"] = arch.mlp_bias
    elif arch.mlp_bias:
        raise ModelLoadError(f"a {arch.model_type} HF config cannot express mlp_bias=True")
    config.update(_sliding_fields(arch))
    return config
