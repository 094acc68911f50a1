"""ModelArchConfig: the shape of a Llama-family model, independent of where it was read from.

Everything the model code, the loaders and the memory pools need to know about a checkpoint
lives here: sizes, rope settings, which optional projections exist (Qwen2's q/k/v bias,
Qwen3's per-head q/k norm), which layers use a sliding window, and the Gemma 3 variations of
the same decoder ((1 + w) norms, sandwich norms, GELU MLP, scaled embeddings, a separate rope
for the sliding layers, logit soft-capping). It is built from an HF `config.json`
(`from_hf_config`) or from GGUF metadata (`from_gguf_metadata`), and can be written back as
an HF config (`to_hf_config`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plugserve.attention.base import AttentionLayer
from plugserve.model.errors import ModelLoadError

# Activations of the gated MLP: SwiGLU (Llama family) and GELU-tanh (Gemma 3).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelArchConfig:
    model_type: str  # "llama" | "qwen2" | "qwen3" | "mistral" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None = plain rope; else a dict with "rope_type" ("linear", "llama3", "freq_factors")
    # and that type's parameters.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q, k and v projections
    attention_out_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False  # bias on gate, up and down projections
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    sliding_window: int | None = None  # the window of the sliding layers, if any
    layer_sliding_window: tuple[int | None, ...] = ()  # per layer; None = full attention
    # Gemma 3 variations (the defaults are the Llama family's).
    hidden_act: str = "silu"  # gated MLP activation: "silu" or "gelu_pytorch_tanh"
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32
    sandwich_norms: bool = False  # norm after attention and MLP too, and a pre-MLP norm
    embedding_scale: float = 1.0  # token embeddings are multiplied by this (in the dtype)
    query_pre_attn_scalar: float | None = None  # attention scale ** -0.5; None = head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Rope of the sliding-window layers when it differs from the others' (Gemma 3: a lower
    # base and no scaling); None = every layer uses rope_theta / rope_scaling.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ModelLoadError("invalid model configuration: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if problems:
            return problems
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for rope, got {self.head_dim}")
        if len(self.layer_sliding_window) != self.num_hidden_layers:
            problems.append(
                f"layer_sliding_window has {len(self.layer_sliding_window)} entries, expected "
                f"one per layer ({self.num_hidden_layers})"
            )
        for window in self.layer_sliding_window:
            if window is not None and (
                not isinstance(window, int) or isinstance(window, bool) or window < 1
            ):
                problems.append(
                    f"a sliding window must be a positive number of tokens, got {window!r}"
                )
                break
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            problems.append(
                f"hidden_act {self.hidden_act!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        for name in ("embedding_scale", "query_pre_attn_scalar", "final_logit_softcapping",
                     "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be positive, got {value!r}")
        return problems

    # ---- derived sizes -------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        """Width of the query projection's output (all heads)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection's output (all KV heads)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scaling(self) -> float:
        """The softmax scale: query_pre_attn_scalar ** -0.5 (Gemma 3), else head_dim ** -0.5."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return float(self.head_dim) ** -0.5

    def layer_uses_local_rope(self, layer_id: int) -> bool:
        """True when layer `layer_id` rotates with the local (sliding-layer) rope."""
        return (
            self.local_rope_theta is not None
            and self.layer_sliding_window[layer_id] is not None
        )

    @property
    def full_attention_layer_ids(self) -> list[int]:
        return [i for i, w in enumerate(self.layer_sliding_window) if w is None]

    @property
    def sliding_window_layer_ids(self) -> list[int]:
        return [i for i, w in enumerate(self.layer_sliding_window) if w is not None]

    @property
    def is_hybrid_sliding_window(self) -> bool:
        """True when some layers attend to a window and others to the whole sequence."""
        return bool(self.full_attention_layer_ids) and bool(self.sliding_window_layer_ids)

    def attention_layers(self) -> list[AttentionLayer]:
        """One `AttentionLayer` per decoder layer, in order (layer_id = layer index)."""
        return [
            AttentionLayer(
                layer_id=i,
                num_heads=self.num_attention_heads,
                num_kv_heads=self.num_key_value_heads,
                head_dim=self.head_dim,
                scaling=self.attention_scaling,
                sliding_window=window,
            )
            for i, window in enumerate(self.layer_sliding_window)
        ]

    # ---- constructors --------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelArchConfig:
        """Build from the dict of an HF `config.json` (Llama, Qwen2, Qwen3, Mistral, Gemma 3)."""
        from plugserve.model.hf_config import arch_from_hf_config

        return arch_from_hf_config(config)

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        tensor_names: Collection[str],
        rope_freq_factors: Sequence[float] | None = None,
    ) -> ModelArchConfig:
        """Build from GGUF key/values; `tensor_names` tells which optional weights exist."""
        from plugserve.model.gguf_metadata import arch_from_gguf_metadata

        return arch_from_gguf_metadata(
            metadata, tensor_names=tensor_names, rope_freq_factors=rope_freq_factors
        )

    def to_hf_config(self) -> dict[str, Any]:
        """An HF `config.json` dict that transformers loads as the same model."""
        from plugserve.model.hf_config import arch_to_hf_config

        return arch_to_hf_config(self)
