"""Pieces of an engine's start-up that depend only on the config and the model: the CPU
kernels ready before any request, the cache policy a sliding-window model needs, the context
a request may fill, the attention backend's context and the engine's own hook relay."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy
import torch

from plugserve.attention.base import AttentionContext
from plugserve.config import EngineConfig
from plugserve.parallel.cross_check import CrossRankCheck
from plugserve.validation import validate_config

if TYPE_CHECKING:
    from plugserve.model.arch import ModelArchConfig
    from plugserve.parallel.runtime import TensorParallel
    from plugserve.plugins import PluginHost
    from plugserve.structs.spec_footprint import SpecFootprint


def prepare_cpu() -> None:
    """Freed memory kept for the next step's tensors, and the CPU kernels compiled now
    (first start only, with a visible status), never inside a request."""
    from plugserve.kernels import build as cpu_kernels
    from plugserve.kernels.cpu_malloc import keep_freed_memory

    keep_freed_memory()
    cpu_kernels.prepare()


def with_model_cache(cfg: EngineConfig, arch: ModelArchConfig,
                     registries: Any) -> tuple[EngineConfig, list[str]]:
    """The config for this model and what the selected plugins refuse about it. A model
    with sliding-window layers gets swa_radix as its default cache policy (radix named
    explicitly is refused), and the plugins are asked whether they run its windows."""
    if not arch.sliding_window_layer_ids:
        return cfg, []
    if cfg.cache == "radix" and "cache" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"cache": "swa_radix"})
    return cfg, validate_config(cfg, registries, sliding_window=True)


def usable_context_len(cfg: EngineConfig, arch: ModelArchConfig,
                       footprint: SpecFootprint | None) -> int:
    """Tokens a request's prompt and output may fill: the configured context (default the
    model's), less the positions a speculative round writes past the last token (up to
    spec_steps + 1), which must stay inside the model's rope table."""
    spec_margin = cfg.spec_steps + 1 if footprint is not None else 0
    return min(cfg.context_len or arch.max_position_embeddings,
               arch.max_position_embeddings - spec_margin)


def attention_context(cfg: EngineConfig, arch: ModelArchConfig, rank_arch: ModelArchConfig,
                      context_len: int, dtype: torch.dtype,
                      device: torch.device) -> AttentionContext:
    """What the attention backend is built with: this rank's heads (all of them without
    tensor parallelism), the model's head size and sliding windows, the engine's limits."""
    return AttentionContext(
        num_heads=rank_arch.num_attention_heads, num_kv_heads=rank_arch.num_key_value_heads,
        head_dim=arch.head_dim, page_size=cfg.page_size,
        max_batch_size=cfg.max_running_requests, context_len=context_len,
        dtype=dtype, device=device, spec_topk=cfg.spec_topk,
        revert_fixes=cfg.revert_fixes,
        sliding_windows=tuple(sorted({w for w in arch.layer_sliding_window if w})),
    )


def lifecycle_plugins(host: PluginHost, cfg: EngineConfig,
                      tp: TensorParallel | None) -> tuple[list[Any], pluggy.PluginManager]:
    """This engine's checker instances and a hook relay for this engine alone: the loaded
    plugins plus those checkers, so two engines in one process never see each other's
    steps. Under tensor parallelism with a checker on, every rank's KV terms are compared
    with rank 0's too."""
    checkers = ([entry.load()(cfg) for entry in host.registries.checkers]
                if cfg.mem_check > 0 else [])
    cross = [CrossRankCheck(tp)] if tp is not None and checkers else []
    return checkers, host.engine_hooks([*cross, *checkers])
