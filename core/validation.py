"""Whether a configuration can run with the registered plugins: `validate_config` gathers
every reason it cannot, so one start-up error can list them all."""

from __future__ import annotations

from typing import Any

from plugserve.attention.capabilities import BackendCapabilities
from plugserve.attention.whitelist import page_tree_whitelist_text
from plugserve.config import EngineConfig
from plugserve.registry import CachePolicyCapabilities, Entry, Registries, SpecCapabilities


def _device_kind(device: str) -> str:
    return device.split(":")[0]


def validate_config(
    config: EngineConfig, registries: Registries, *, sliding_window: bool = False
) -> list[str]:
    """Every reason `config` cannot run with the registered plugins (empty list = fine).

    `sliding_window` says the model has sliding-window layers (known once its config is read).
    """
    reasons: list[str] = []
    for registry, name in (
        (registries.attention, config.attention),
        (registries.cache, config.cache),
        (registries.spec, config.spec),
    ):
        if name not in registry:
            reasons.append(
                f"unknown {registry.kind} {name!r}; available: {', '.join(registry.names())}"
            )
    # The default grammar backend is optional (without it, constrained requests are refused
    # with the reason); another one named must exist.
    default_grammar = type(config).model_fields["grammar_backend"].default
    if config.grammar_backend != default_grammar and config.grammar_backend not in \
            registries.grammar:
        reasons.append(f"unknown grammar backend {config.grammar_backend!r}; available: "
                       f"{', '.join(registries.grammar.names()) or 'none'}")
    if config.attention in registries.attention:
        reasons += _attention_reasons(
            config, registries.attention.get(config.attention), sliding_window
        )
        if config.tp_size > 1 and not registries.attention.get(config.attention).capabilities \
                .tensor_parallel:
            able = [e.name for e in registries.attention if e.capabilities.tensor_parallel]
            reasons.append(
                f"attention backend {config.attention!r} does not support tensor parallelism "
                f"(tp_size={config.tp_size}); backends that do: {', '.join(able) or 'none'}"
            )
    # A cache policy named explicitly must support windows; the default (`radix`, not set)
    # is resolved by the engine to `swa_radix` for a windowed model.
    if sliding_window and "cache" in config.model_fields_set and config.cache in registries.cache:
        cache = registries.cache.get(config.cache)
        caps = cache.capabilities or CachePolicyCapabilities()
        if not caps.sliding_window:
            windowed = sorted(e.name for e in registries.cache
                              if (e.capabilities or CachePolicyCapabilities()).sliding_window)
            reasons.append(
                f"the model has sliding-window layers; cache policy {config.cache!r} does not "
                f"support sliding windows; use one that does: {', '.join(windowed) or 'none'}"
            )
    if config.spec != "none" and config.spec in registries.spec:
        reasons += _spec_reasons(config, registries.spec.get(config.spec))
    if config.mem_check > 0 and len(registries.checkers) == 0:
        reasons.append(
            f"mem_check={config.mem_check} needs an invariant checker, but none is registered; "
            "install plugserve-checker (pip install -e plugins/checker) or use mem_check=0"
        )
    return reasons


def _attention_reasons(config: EngineConfig, entry: Entry[Any], sliding_window: bool) -> list[str]:
    reasons: list[str] = []
    name = entry.name
    caps: BackendCapabilities = entry.capabilities
    device = _device_kind(config.device)
    if device not in caps.devices:
        reasons.append(
            f"attention backend {name!r} does not run on {device!r}; "
            f"it supports {sorted(caps.devices)}"
        )
    if config.dtype not in caps.dtypes:
        reasons.append(
            f"attention backend {name!r} does not support dtype {config.dtype!r}; "
            f"it supports {sorted(caps.dtypes)}"
        )
    kv = config.kv_cache_dtype
    if kv not in caps.kv_cache_dtypes and kv != config.dtype:  # the model's dtype is "auto"
        reasons.append(
            f"attention backend {name!r} does not read a {kv!r} KV cache "
            f"(kv_cache_dtype={kv!r}); it reads {sorted(caps.kv_cache_dtypes)}"
        )
    if caps.page_sizes is not None and config.page_size not in caps.page_sizes:
        reasons.append(
            f"attention backend {name!r} does not support page_size "
            f"{config.page_size}; it supports {sorted(caps.page_sizes)}"
        )
    if sliding_window and not caps.sliding_window:
        reasons.append(
            f"the model has sliding-window layers; attention backend {name!r} does not "
            "support sliding windows"
        )
    speculative = config.spec != "none"
    if speculative and not caps.custom_mask:
        reasons.append(
            f"speculative decoding needs a tree-mask verify; attention backend {name!r} has none"
        )
    if speculative and config.spec_topk > 1:
        if config.page_size == 1 and not caps.topk_gt1:
            reasons.append(
                f"attention backend {name!r} does not support topk>1 drafting "
                f"(spec_topk={config.spec_topk})"
            )
        if config.page_size > 1 and not entry.page_tree_allowed():
            reasons.append(
                f"attention backend {name!r} ({entry.origin()}) may not run page_size>1 "
                f"(page_size={config.page_size}) with topk>1 (spec_topk={config.spec_topk}); "
                f"allowed backends: {page_tree_whitelist_text()}"
            )
    return reasons


def _spec_reasons(config: EngineConfig, entry: Entry[Any]) -> list[str]:
    reasons: list[str] = []
    caps: SpecCapabilities = entry.capabilities or SpecCapabilities()
    if config.spec_topk > 1 and not caps.topk_gt1:
        reasons.append(
            f"speculative algorithm {entry.name!r} does not support topk>1 "
            f"(spec_topk={config.spec_topk}); use spec_topk=1"
        )
    if config.overlap and not caps.overlap:
        reasons.append(f"speculative algorithm {entry.name!r} does not support the overlap loop")
    shipped = caps.default_draft_for_default_model and config.model is None
    if caps.needs_draft_model and not config.draft_model and not shipped:
        reasons.append(
            f"speculative algorithm {entry.name!r} needs a draft model; set draft_model "
            "(--draft-model PATH)"
            + (" (it ships one only for the built-in default model)"
               if caps.default_draft_for_default_model else "")
        )
    return reasons
