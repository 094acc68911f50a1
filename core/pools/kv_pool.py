"""Token-to-KV pool: per-layer K and V buffers indexed by KV slot.

Page 0 is never handed out: padded or dummy writes go there, so a stray index can never
corrupt a live request. Usable slots are `[page_size, (num_pages + 1) * page_size)`.
"""

from __future__ import annotations

import torch


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
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v.to(self.dtype))

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
