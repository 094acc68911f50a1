"""Packed CPU linears against F.linear: bit for bit in half precision (the same oneDNN path),
within float32 rounding in float32 (oneDNN blocks its sums its own way)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from plugserve.kernels import packed_linear, skinny_linear
from plugserve.kernels.packed_linear import pack, pack_kind, packed
from plugserve.model.layers import linear


def _kind_or_skip(dtype: torch.dtype) -> str:
    kind = pack_kind(torch.empty(2, 2, dtype=dtype))
    if kind is None:
        pytest.skip(f"no packed {dtype} GEMM on this CPU (F.linear is used)")
    return kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_equals_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    kind = _kind_or_skip(dtype)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    p = pack(w)
    assert p is not None
    if dtype == torch.float32 and (kind == "onednn" or rows == 1):
        # 80 products of N(0, 1) values: sums of about 9, rounding errors ~1e-6 of that.
        torch.testing.assert_close(p(x, bias), F.linear(x, w, bias), rtol=1e-5, atol=2e-5)
    else:
        assert torch.equal(p(x, bias), F.linear(x, w, bias))


def test_float32_model_layers_use_the_pack() -> None:
    kind = _kind_or_skip(torch.float32)
    assert kind == ("onednn" if torch.backends.mkldnn.is_available() else "mkl")
    w = torch.nn.Parameter(torch.randn(40, 24))
    # More rows than the few-row kernel takes (plugserve.kernels.skinny_linear): the pack.
    x = torch.randn(skinny_linear.MAX_ROWS + 5, 24)
    p = packed(w)
    assert p is not None
    with torch.inference_mode():
        assert torch.equal(linear(x, w, None), p(x, None))
        torch.testing.assert_close(linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert linear(x, w, None, out_dtype=torch.float64).dtype == torch.float64


def test_pack_follows_in_place_writes_and_dies_with_the_weight() -> None:
    _kind_or_skip(torch.float32)
    w = torch.nn.Parameter(torch.randn(8, 6))
    first = packed(w)
    assert first is not None and packed(w) is first
    with torch.no_grad():
        w.mul_(3)
    again = packed(w)
    assert again is not first
    x = torch.randn(2, 6)
    torch.testing.assert_close(again(x, None), F.linear(x, w.detach()), rtol=1e-5, atol=1e-5)
    key = id(w)
    assert key in packed_linear._packs
    del w, first, again
    gc.collect()
    assert key not in packed_linear._packs


def test_no_pack_off_the_cpu_or_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pack_kind(torch.empty(3)) is None  # not a matrix
    monkeypatch.setattr(packed_linear, "_ENABLED", False)
    assert pack_kind(torch.empty(2, 2)) is None
    assert pack(torch.empty(2, 2)) is None
