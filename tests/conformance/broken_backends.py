"""Deliberately broken variants of the docs' example backend: test doubles proving that the
conformance suite can fail. Each gets one fact of the backend contract wrong; registered as a
plugin ("broken_examples") by the `example_plugins` fixture."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from plugserve_attention_example.backend import ExampleBackend
from plugserve_attention_example.plugin import CAPABILITIES

from plugserve.hookspecs import hookimpl
from plugserve.structs.forward_batch import ForwardBatch


class IgnoresPrefixOffset(ExampleBackend):
    """Causal mask without the cached-prefix offset: new token j sees row positions <= j,
    as if nothing were cached (right for a whole prefill, wrong after a prefix hit or for a
    later chunk)."""

    name = "example_no_prefix_offset"

    def causal_mask(self, prefix: int, ext: int, seq_len: int,
                    device: torch.device) -> torch.Tensor:
        query_row = torch.arange(ext, device=device)
        return torch.arange(seq_len, device=device)[None, :] <= query_row[:, None]


class AssumesContiguousSlots(ExampleBackend):
    """Reads a request's KV from consecutive slots after its first one (right only while
    the request fits in one page, or its pages happen to be consecutive)."""

    name = "example_contiguous_slots"

    def row_slots(self, fb: ForwardBatch, request: int, length: int) -> torch.Tensor:
        first = fb.req_to_token[fb.req_pool_indices[request], 0].long()
        return first + torch.arange(length, device=first.device)


class DecodeKVOffByOne(ExampleBackend):
    """Decode reads seq_len - 1 keys: it misses the token being decoded, whose K/V the
    forward has just stored."""

    name = "example_kv_len_off_by_one"

    def decode_kv_lens(self, fb: ForwardBatch) -> list[int]:
        return [n - 1 for n in fb.seq_lens_cpu]


class IgnoresSlidingWindow(ExampleBackend):
    """Declares `sliding_window=True` (the example's capabilities) but attends to every key:
    a capability declared and not honoured, which the suite must fail."""

    name = "example_ignores_window"

    def attend(self, q: torch.Tensor, layer: Any, fb: ForwardBatch) -> torch.Tensor:
        return super().attend(q, dataclasses.replace(layer, sliding_window=None), fb)


class AttendsToUnroundedNewKV(ExampleBackend):
    """Declares every `kv_cache_dtypes`, stores the new K/V in the narrower cache, but attends
    to them as handed in (unrounded) instead of as stored: what a later step reads differs
    from what this one attended to."""

    name = "example_unrounded_new_kv"
    capabilities = dataclasses.replace(
        CAPABILITIES, kv_cache_dtypes=frozenset({"auto", "bfloat16", "float8_e4m3",
                                                 "float8_e5m2"}))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                forward_batch: ForwardBatch) -> torch.Tensor:
        pool, where = forward_batch.kv_pool, forward_batch.out_cache_loc
        pool.set_kv(layer.layer_id, where, k, v)
        stored = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        for buffers, new, old in ((pool.k_buffer, k, stored[0]), (pool.v_buffer, v, stored[1])):
            wide = old.to(q.dtype)
            wide[where] = new
            buffers[layer.layer_id] = wide
        try:
            return self.attend(q, layer, forward_batch)
        finally:
            pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id] = stored


BROKEN: dict[str, type[ExampleBackend]] = {
    cls.name: cls for cls in (IgnoresPrefixOffset, AssumesContiguousSlots, DecodeKVOffByOne,
                              IgnoresSlidingWindow, AttendsToUnroundedNewKV)
}


@hookimpl
def plugserve_register_attention_backends(register: Any) -> None:
    for name, cls in BROKEN.items():
        register(name, lambda cls=cls: cls, getattr(cls, "capabilities", CAPABILITIES),
                 description=cls.__doc__ or "")
