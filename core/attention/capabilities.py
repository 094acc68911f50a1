"""What an attention backend supports, as data, and how it says where it was verified.

Every field is a claim the engine trusts at start-up (`plugserve.validation.validate_config`)
and the conformance suite holds the backend to. The defaults claim the minimum (float32 on the
CPU, pages of 1 token, no tree mask, no topk>1, no sliding window, no slot translation, a KV
cache of the model's own dtype), so a
capability added later is claimed by no backend that did not declare it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackendCapabilities:
    """Given once, when the backend is registered (`register(name, loader, capabilities)`);
    the backend class carries none. Whether a backend may run page_size>1 with topk>1 is not
    a capability: the whitelist `plugserve.registry.PAGE_TREE_WHITELIST` alone decides."""

    devices: frozenset[str] = frozenset({"cpu"})
    dtypes: frozenset[str] = frozenset({"float32"})
    page_sizes: frozenset[int] | None = frozenset({1})  # None = any page size
    custom_mask: bool = False  # speculative verify with a tree mask (every spec algorithm)
    topk_gt1: bool = False  # topk>1 tree drafting at page_size 1 (per-branch KV lists)
    sliding_window: bool = False  # models with sliding-window layers
    # Windowed layers may live in a separate, smaller pool: the backend reads a windowed
    # layer's buffer through `kv_pool.slots_for_layer` (docs/backends.md).
    swa_slot_translation: bool = False
    # `EngineConfig.kv_cache_dtype` values the backend reads ("auto" = the model's dtype,
    # always readable); a narrower cache (bfloat16, float8_e4m3, float8_e5m2) is widened to
    # the queries' dtype by the backend as it reads.
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    # Runs on one tensor-parallel rank's heads (AttentionContext and AttentionLayer carry the
    # rank's head counts); tp_size > 1 is refused for a backend without it.
    tensor_parallel: bool = False
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {
            "devices": sorted(self.devices),
            "dtypes": sorted(self.dtypes),
            "page_sizes": "any" if self.page_sizes is None else sorted(self.page_sizes),
            "custom_mask": self.custom_mask,
            "topk>1": self.topk_gt1,
            "sliding_window": self.sliding_window,
            "swa_slot_translation": self.swa_slot_translation,
            "kv_cache_dtypes": sorted(self.kv_cache_dtypes),
            "tensor_parallel": self.tensor_parallel,
        }


def gpu_verification_note(backend: str, verified_on: str | None) -> str:
    """A GPU backend's first note: where and when a real GPU run of the conformance suite
    passed, or that none has and the command that would verify it."""
    if verified_on is None:
        return ("not verified on a GPU yet: run `plugserve conformance --attention "
                f"{backend} --device cuda`")
    return f"verified on a GPU: {verified_on}"


# The built-in reference backend's declaration (`plugserve.attention.torch_native`), here so
# that registering it imports nothing heavy.
TORCH_NATIVE_CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    page_sizes=None,  # reads slots through req_to_token: any page size, any page order
    custom_mask=True,
    topk_gt1=True,
    sliding_window=True,
    swa_slot_translation=True,  # windowed layers read through kv_pool.slots_for_layer
    kv_cache_dtypes=frozenset({"auto", "bfloat16", "float8_e4m3", "float8_e5m2"}),
    tensor_parallel=True,  # sized from AttentionContext's (the rank's) head counts
)
