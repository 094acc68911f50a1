"""Building a ModelArchConfig from GGUF key/values (llama.cpp's naming)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError
from plugserve.model.sliding_window import window_value

# GGUF general.architecture -> our model_type (llama.cpp writes Mistral models as "llama").
SUPPORTED_GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
}


# GGUF architectures we know but cannot read, and why.
_REFUSED_GGUF_ARCHITECTURES: dict[str, str] = {
    "gemma3": (
        "llama.cpp's gemma3 metadata lacks what this engine needs to run it exactly: which "
        "layers are local (no gemma3.attention.sliding_window_pattern; llama.cpp hard-codes "
        "5 local : 1 global), the local layers' rope base (no gemma3.rope.freq_base_swa; "
        "hard-coded 10000) and the attention scale (no query_pre_attn_scalar; derived from "
        "the model size); its norm weights are also stored as 1 + w. Load the HF folder "
        "(Gemma3ForCausalLM) instead"
    ),
}


def float32_value(value: Any) -> float:
    """GGUF stores float32: give back the shortest decimal that reads as the same float32
    (so 9.999999747e-06 becomes 1e-05, the value the original config held)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="0"))


def _eos_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _rope_scaling(
    metadata: Mapping[str, Any], prefix: str, head_dim: int,
    rope_freq_factors: Sequence[float] | None,
) -> dict[str, Any] | None:
    scaling_type = metadata.get(prefix + "rope.scaling.type", "none")
    if rope_freq_factors is not None:
        if len(rope_freq_factors) != head_dim // 2:
            raise ModelLoadError(
                f"rope_freqs holds {len(rope_freq_factors)} factors, expected head_dim/2 = "
                f"{head_dim // 2}"
            )
        return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in rope_freq_factors)}
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        factor = metadata.get(prefix + "rope.scaling.factor")
        if factor is None:
            raise ModelLoadError(f"linear rope scaling without {prefix}rope.scaling.factor")
        return {"rope_type": "linear", "factor": float32_value(factor)}
    raise UnsupportedArchitectureError(
        f"GGUF rope scaling type {scaling_type!r} is not supported; supported: none, linear, "
        "and per-frequency factors (rope_freqs)"
    )


def arch_from_gguf_metadata(
    metadata: Mapping[str, Any],
    *,
    tensor_names: Collection[str],
    rope_freq_factors: Sequence[float] | None = None,
) -> ModelArchConfig:
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch in _REFUSED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {gguf_arch!r} is not supported: "
            f"{_REFUSED_GGUF_ARCHITECTURES[gguf_arch]}; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if gguf_arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    prefix = f"{gguf_arch}."

    def need(key: str) -> Any:
        value = metadata.get(prefix + key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {prefix + key!r}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = metadata.get(prefix + "attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise UnsupportedArchitectureError(
            f"per-layer KV head counts ({prefix}attention.head_count_kv = {kv_heads!r}) are "
            "not supported; expected one integer"
        )
    head_dim = int(metadata.get(prefix + "attention.key_length") or hidden // heads)
    rope_dims = int(metadata.get(prefix + "rope.dimension_count") or head_dim)
    if rope_dims != head_dim:
        raise UnsupportedArchitectureError(
            f"rope over {rope_dims} of {head_dim} head dims is not supported; only whole heads"
        )
    vocab = metadata.get(prefix + "vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ModelLoadError(f"GGUF metadata has neither {prefix}vocab_size nor a token list")
    num_layers = int(need("block_count"))
    window = window_value(
        metadata.get(prefix + "attention.sliding_window"), prefix + "attention.sliding_window"
    )
    names = set(tensor_names)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelArchConfig(
        model_type=SUPPORTED_GGUF_ARCHITECTURES[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float32_value(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float32_value(metadata.get(prefix + "rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, prefix, head_dim, rope_freq_factors),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=window,
        layer_sliding_window=(window,) * num_layers,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(metadata),
    )
