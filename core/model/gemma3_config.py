"""Gemma 3 text models (`Gemma3ForCausalLM`, transformers' `Gemma3TextConfig`) as a
`ModelArchConfig`, and back.

The decoder is the Llama one with Gemma's switches on: (1 + w) RMSNorms, q/k norms, sandwich
norms (post-attention, pre- and post-feed-forward), a GELU-tanh MLP, embeddings scaled by
sqrt(hidden_size), attention scale query_pre_attn_scalar ** -0.5, tied embeddings by default,
optional final logit soft-capping, and two ropes: `sliding_attention` layers rotate with
their own base (`rope_local_base_freq`, 10,000 by default) and no scaling, global layers with
`rope_theta` (1,000,000 by default) and `rope_scaling`. Absent keys take transformers 5.23's
`Gemma3TextConfig` defaults. What the engine cannot run is refused: attention-logit
soft-capping (no attention backend implements it) and bidirectional attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError
from plugserve.model.hf_config import id_tuple, required, rope_from_hf
from plugserve.model.sliding_window import gemma3_layer_windows

ACTIVATION = "gelu_pytorch_tanh"
# Gemma3TextConfig's defaults for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": ACTIVATION,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
_GLOBAL_THETA = 1_000_000.0
_LOCAL_THETA = 10_000.0


def _get(config: Mapping[str, Any], key: str) -> Any:
    return config[key] if key in config else _DEFAULTS[key]


def _rope_params(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (global, local) rope parameter dicts, from the 5.x layout (rope_parameters keyed
    by layer type) or the 4.x one (rope_theta, rope_scaling, rope_local_base_freq)."""
    params = config.get("rope_parameters")
    if params:
        if not isinstance(params, Mapping) or not (
            {"full_attention", "sliding_attention"} & set(params)
        ):
            raise ModelLoadError(
                "a Gemma 3 config's rope_parameters must be keyed by layer type "
                f"(full_attention, sliding_attention), got {params!r}"
            )
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(config.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", config.get("rope_theta", _GLOBAL_THETA))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", _LOCAL_THETA))
    return full, local


def _refuse_unsupported(config: Mapping[str, Any]) -> None:
    cap = config.get("attn_logit_softcapping")
    if cap is not None:
        raise UnsupportedArchitectureError(
            f"attn_logit_softcapping={cap!r} is not supported: no attention backend applies "
            "soft-capping to attention scores; only null (Gemma 3's value) is allowed"
        )
    if config.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError(
            "use_bidirectional_attention=true is not supported; only causal attention (false)"
        )
    act = _get(config, "hidden_activation")
    if act != ACTIVATION:
        raise UnsupportedArchitectureError(
            f"hidden_activation {act!r} is not supported for Gemma 3; only {ACTIVATION!r}"
        )


def gemma3_arch_from_hf(config: Mapping[str, Any]) -> ModelArchConfig:
    _refuse_unsupported(config)
    hidden = int(required(config, "hidden_size"))
    num_layers = int(required(config, "num_hidden_layers"))
    max_positions = int(_get(config, "max_position_embeddings"))
    full, local = _rope_params(config)
    theta, scaling = rope_from_hf(
        {"rope_parameters": full, "max_position_embeddings": max_positions}
    )
    local_theta, local_scaling = rope_from_hf(
        {"rope_parameters": local, "max_position_embeddings": max_positions}
    )
    windows = gemma3_layer_windows(config, num_layers)
    bias = bool(_get(config, "attention_bias"))
    softcap = config.get("final_logit_softcapping")
    return ModelArchConfig(
        model_type="gemma3",
        vocab_size=int(required(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required(config, "intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=int(required(config, "num_attention_heads")),
        num_key_value_heads=int(_get(config, "num_key_value_heads")),
        head_dim=int(_get(config, "head_dim")),
        rms_norm_eps=float(_get(config, "rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings")),
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=True,
        sliding_window=next((w for w in windows if w is not None), None),
        layer_sliding_window=windows,
        hidden_act=ACTIVATION,
        norm_unit_offset=True,
        sandwich_norms=True,
        embedding_scale=hidden**0.5,
        query_pre_attn_scalar=float(_get(config, "query_pre_attn_scalar")),
        final_logit_softcapping=None if softcap is None else float(softcap),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        bos_token_id=_get(config, "bos_token_id"),
        eos_token_ids=id_tuple(_get(config, "eos_token_id")),
    )


def _rope_dict(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    return {"rope_type": "default", **(scaling or {}), "rope_theta": theta}


def _int_if_whole(value: float | None) -> float | int | None:
    """transformers' Gemma3TextConfig types query_pre_attn_scalar as an int."""
    return int(value) if value is not None and float(value).is_integer() else value


def gemma3_arch_to_hf(arch: ModelArchConfig) -> dict[str, Any]:
    """A transformers 5.x `Gemma3TextConfig` dict for `arch`."""
    expected = {
        "qk_norm": True, "norm_unit_offset": True, "sandwich_norms": True,
        "hidden_act": ACTIVATION, "mlp_bias": False, "attention_out_bias": arch.attention_bias,
        "embedding_scale": arch.hidden_size**0.5,
    }
    wrong = [f"{k}={getattr(arch, k)!r}" for k, v in expected.items() if getattr(arch, k) != v]
    local_theta = arch.local_rope_theta
    if local_theta is None:
        wrong.append("local_rope_theta=None")
    if wrong or local_theta is None:
        raise ModelLoadError(f"a Gemma 3 HF config cannot express {', '.join(wrong)}")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_activation": ACTIVATION,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias,
        "query_pre_attn_scalar": _int_if_whole(arch.query_pre_attn_scalar),
        "final_logit_softcapping": arch.final_logit_softcapping,
        "attn_logit_softcapping": None,
        # transformers always builds the sliding mask, so it needs a window even when no
        # layer uses one.
        "sliding_window": arch.sliding_window or arch.max_position_embeddings,
        "layer_types": [
            "full_attention" if w is None else "sliding_attention"
            for w in arch.layer_sliding_window
        ],
        "rope_parameters": {
            "full_attention": _rope_dict(arch.rope_theta, arch.rope_scaling),
            "sliding_attention": _rope_dict(local_theta, arch.local_rope_scaling),
        },
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": (
            arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1 else list(arch.eos_token_ids)
        ),
        "torch_dtype": "float32",
    }
