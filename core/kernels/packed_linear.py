"""Linear layers against weights packed once for the CPU's GEMM library.

`F.linear` on the CPU re-lays-out its weight on every call; at batch 1 a decode step is a
string of GEMVs that only stream weights, and the re-layout costs as much as the product.
Packing once at first use removes it:

- oneDNN's packed matmul (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`)
  for float32, and for bfloat16 / float16 on a CPU with native half dot products
  (AVX512-BF16, AMX, AVX512-FP16). In float32 it runs 10-40% faster than MKL's sgemm (which
  F.linear uses) at the decoder's shapes on the CPUs measured, and differs from F.linear
  within float32 rounding (its own blocking of the sums); in half precision it is F.linear's
  own path, bit for bit.
- MKL's packed sgemm (`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`) for float32
  in a build without oneDNN, bit-identical to `F.linear` for two or more rows.

Anything else (a GPU weight, a build without either, half precision without native kernels,
`PLUGSERVE_CPU_KERNELS=0`) uses `F.linear` (or, for half-precision weights without native
kernels, `plugserve.kernels.widening_gemm`: see `plugserve.model.layers.linear`). A pack is cached per weight tensor and rebuilt
when the weight is written in place (its version counter moves); it goes away with its
weight. The reference is `F.linear` itself (tests/kernels/test_packed_linear.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plugserve.kernels import build
from plugserve.kernels.build import enabled_by_environment

HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _onednn_half(dtype: torch.dtype) -> bool:
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    return bool(mkldnn._is_mkldnn_fp16_supported())


def half_is_native(dtype: torch.dtype) -> bool:
    """True when this CPU multiplies `dtype` (bf16/fp16) natively (AVX512-BF16, AMX,
    AVX512-FP16), as oneDNN reports it (asked once per dtype: every linear asks). Where
    the CPU kernels run a copy below their best ISA (`PLUGSERVE_CPU_ISA=avx2`, or a test's
    `use_isa`), bf16 counts as native only if that copy has bf16 dot products, so the whole
    engine takes the paths of a CPU with that ISA."""
    if not _onednn_half(dtype):
        return False
    library = build.library() if _ENABLED else None
    return library is None or dtype != torch.bfloat16 or library.bf16_dot


def pack_kind(weight: torch.Tensor) -> str | None:
    """'onednn' (float32 or native half), 'mkl' (float32 without oneDNN) or None (use
    F.linear) for this weight here."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not _ENABLED:
        return None
    if weight.dtype == torch.float32:
        if torch.backends.mkldnn.is_available():
            return "onednn"
        if torch.backends.mkl.is_available():
            return "mkl"
        return None
    if weight.dtype in HALF and torch.backends.mkldnn.is_available() and half_is_native(
        weight.dtype
    ):
        return "onednn"
    return None


@dataclass(frozen=True)
class PackedWeight:
    kind: str
    packed: torch.Tensor
    weight: torch.Tensor  # the original (MKL's packed linear takes it for its shape)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 0:
            return F.linear(x, self.weight, bias)
        if self.kind == "mkl":
            out: torch.Tensor = torch.ops.mkl._mkl_linear(x, self.packed, self.weight, bias, 1)
            return out
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return out


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` packed for this CPU, or None where `F.linear` is used."""
    kind = pack_kind(weight)
    if kind is None:
        return None
    w = weight.detach()
    if kind == "mkl":
        return PackedWeight(kind, torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w)
    return PackedWeight(kind, torch.ops.mkldnn._reorder_linear_weight(w), w)


_ENABLED = enabled_by_environment()

# id(weight) -> (version, weak reference to the weight, derived value); an entry goes away
# with its weight.
Derived = tuple[int, "weakref.ref[torch.Tensor]", object]

# Every store `per_weight` has filled (by id): what `derived_bytes` counts.
_stores: dict[int, dict[int, Derived]] = {}


def per_weight(store: dict[int, Derived], weight: torch.Tensor,
               make: Callable[[torch.Tensor], object]) -> object:
    """`make(weight)`, computed once per weight and version and kept in `store`."""
    _stores.setdefault(id(store), store)
    key = id(weight)
    version = weight_version(weight)
    hit = store.get(key)
    if hit is not None and hit[1]() is weight and hit[0] == version:
        return hit[2]
    value = make(weight)
    if hit is None or hit[1]() is not weight:
        weakref.finalize(weight, store.pop, key, None)
    store[key] = (version, weakref.ref(weight), value)
    return value


def derived_bytes(weight: torch.Tensor) -> int:
    """Bytes held for `weight` by every kernel's cache of derived layouts (the oneDNN / MKL
    pack, the panel GEMM's and the AMX linear's packs): memory beside the weight itself."""
    key, total = id(weight), 0
    for store in list(_stores.values()):  # a store may be added meanwhile
        hit = store.get(key)
        if hit is not None and hit[1]() is weight:
            total += _value_bytes(hit[2])
    return total


def _value_bytes(value: object) -> int:
    if isinstance(value, PackedWeight):
        return _value_bytes(value.packed)
    if isinstance(value, torch.Tensor):
        if value.is_mkldnn:  # oneDNN's opaque blocked tensor: its logical size
            return value.numel() * value.element_size()
        return int(value.untyped_storage().nbytes())
    if isinstance(value, (tuple, list)):
        return sum(_value_bytes(v) for v in value)
    return 0


def weight_version(weight: torch.Tensor) -> int:
    """The in-place write counter; an inference tensor has none (-1: packed once)."""
    if weight.is_inference():
        return -1
    return int(weight._version)


_packs: dict[int, Derived] = {}


def packed(weight: torch.Tensor) -> PackedWeight | None:
    """The cached pack of `weight` (see `pack`)."""
    value = per_weight(_packs, weight, pack)
    assert value is None or isinstance(value, PackedWeight)
    return value


def upcasts_matmul(weight: torch.Tensor) -> bool:
    """True when matmuls against `weight` (a weight or an activation) are faster in float32 on
    this machine: half precision on a CPU without native half dot products. The linears then
    read half-precision weights as they are (`plugserve.kernels.widening_gemm`); attention
    outside the CPU kernels (SDPA) computes in float32."""
    return weight.dtype in HALF and weight.is_cpu and not half_is_native(weight.dtype)
