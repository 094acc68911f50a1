"""Token-to-KV pool: per-layer K and V buffers indexed by KV slot.

Page 0 is never handed out: padded or dummy writes go there, so a stray index can never
corrupt a live request. Usable slots are `[page_size, (num_pages + 1) * page_size)`.

The buffers hold the pool's `dtype`: the model's, or a narrower KV cache dtype
(`EngineConfig.kv_cache_dtype`: bfloat16, float8_e4m3, float8_e5m2) that attention widens as it
reads. fp8 stores saturate at the format's largest finite value (a plain cast would make an
out-of-range value NaN, e4m3fn having no infinity), as the CPU kernels' stores do.
"""

from __future__ import annotations

import torch

from plugserve.pools.slot_runs import run_start, store_rows

# `EngineConfig.kv_cache_dtype` names (vLLM / SGLang's) -> what the pools store.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,  # the model's own dtype where it runs float32
    "bfloat16": torch.bfloat16,
    "float8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pools store for `kv_cache_dtype` `name` ("auto" = the model's)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of auto, "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` stores it: fp8 saturated at its largest finite value."""
    if x.dtype == dtype:
        return x
    if dtype in _FP8:
        top = torch.finfo(dtype).max
        return x.clamp(-top, top).to(dtype)
    return x.to(dtype)


class KVPool:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        layer_ids: list[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        name: str = "full",
    ) -> None:
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_ids = list(layer_ids)
        buffer_slots = (num_pages + 1) * page_size
        shape = (buffer_slots, num_kv_heads, head_dim)
        self.k_buffer = {i: torch.zeros(shape, dtype=dtype, device=self.device) for i in layer_ids}
        self.v_buffer = {i: torch.zeros(shape, dtype=dtype, device=self.device) for i in layer_ids}

    @property
    def total_slots(self) -> int:
        """Slots the allocator can hand out (the padding page excluded)."""
        return self.num_pages * self.page_size

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        start = run_start(loc)  # the same slots for K and V: asked once
        for buffer, rows in ((self.k_buffer[layer_id], k), (self.v_buffer[layer_id], v)):
            stored = to_cache_dtype(rows, self.dtype)
            if self.dtype in _FP8:  # torch has no fp8 index_copy_: copy the bytes
                buffer, stored = buffer.view(torch.uint8), stored.view(torch.uint8)
            store_rows(buffer, loc, stored, start)

    def slots_for_layer(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """The buffer slots holding the KV of `slots` for `layer_id`: the same slots here (a
        `HybridKVPool` translates its windowed layers' slots)."""
        return slots

    def is_windowed(self, layer_id: int) -> bool:
        """True when `layer_id` keeps its KV in a separate sliding-window pool."""
        return False

    def get_k(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_v(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the KV of slots `src` into slots `dst` in every layer."""
        for layer_id in self.layer_ids:
            self.k_buffer[layer_id][dst] = self.k_buffer[layer_id][src]
            self.v_buffer[layer_id][dst] = self.v_buffer[layer_id][src]
