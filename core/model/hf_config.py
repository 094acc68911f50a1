"""Reading and writing HF `config.json` dicts for the Llama-family architectures we run.

Both the transformers 4.x layout (`rope_theta` + `rope_scaling`, `use_sliding_window` +
`max_window_layers`) and the 5.x layout (`rope_parameters`, `layer_types`) are understood.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError

# HF architecture class name -> our model_type.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
ARCHITECTURE_OF_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

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
    if hf_model_type in ARCHITECTURE_OF_MODEL_TYPE:
        return str(hf_model_type)
    raise UnsupportedArchitectureError(
        f"model_type {hf_model_type!r} (no 'architectures' entry) is not supported; "
        f"supported architectures: {_supported_list()}"
    )


def _required(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ModelLoadError(f"config lacks the required field {key!r}")
    return config[key]


def _id_tuple(value: Any) -> tuple[int, ...]:
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
        scaling["original_max_position_embeddings"] = _required(config, "max_position_embeddings")
    missing = [k for k in SUPPORTED_ROPE_TYPES[rope_type] if scaling.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope scaling {rope_type!r} lacks the parameter(s) {missing}")
    kept = {k: scaling[k] for k in SUPPORTED_ROPE_TYPES[rope_type]}
    return float(theta), {"rope_type": rope_type, **kept}


def layer_windows_from_hf(
    config: Mapping[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, ...]:
    """The sliding window of every layer (None = full attention)."""
    window = config.get("sliding_window")
    if model_type == "llama":
        return (None,) * num_layers
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        window = None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelLoadError(
                f"layer_types has {len(layer_types)} entries, expected num_hidden_layers "
                f"({num_layers})"
            )
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedArchitectureError(
                f"layer types {unknown} are not supported; supported: full_attention, "
                "sliding_attention"
            )
        if "sliding_attention" in layer_types and window is None:
            raise ModelLoadError(
                "layer_types names sliding_attention layers but sliding_window is unset"
            )
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if window is None:
        return (None,) * num_layers
    if model_type == "mistral":
        return (int(window),) * num_layers
    first_sliding = int(config.get("max_window_layers", 0))
    return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))


def arch_from_hf_config(config: Mapping[str, Any]) -> ModelArchConfig:
    model_type = model_type_of(config)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(
            f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU MLP)"
        )
    hidden = int(_required(config, "hidden_size"))
    heads = int(_required(config, "num_attention_heads"))
    num_layers = int(_required(config, "num_hidden_layers"))
    rope_theta, rope_scaling = rope_from_hf(config)
    windows = layer_windows_from_hf(config, model_type, num_layers)
    used_windows = {w for w in windows if w is not None}
    if len(used_windows) > 1:
        raise UnsupportedArchitectureError(f"layers use different sliding windows {used_windows}")
    bias = bool(config.get("attention_bias", False))
    return ModelArchConfig(
        model_type=model_type,
        vocab_size=int(_required(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_required(config, "intermediate_size")),
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
        eos_token_ids=_id_tuple(config.get("eos_token_id")),
    )


def _check_expressible(arch: ModelArchConfig) -> None:
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
