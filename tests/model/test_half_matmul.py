"""bf16/fp16 matmuls on CPUs without native half kernels read the weights as they are: the
widening GEMM with the CPU kernels, a float32 copy made for that call only without them. No
float32 copy of a weight outlives the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugserve.kernels import build, packed_linear, widening_gemm
from plugserve.kernels.packed_linear import upcasts_matmul
from plugserve.model import layers
from plugserve.model.layers import linear, multiplies_as_stored


def test_fp32_weights_are_used_as_they_are() -> None:
    w = torch.randn(4, 3)
    assert not upcasts_matmul(w) and multiplies_as_stored(w)
    x = torch.randn(200, 3)
    torch.testing.assert_close(linear(x, w, None), F.linear(x, w))


def _not_native(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(packed_linear, "half_is_native", lambda dtype: False)
    mp.setattr(widening_gemm, "half_is_native", lambda dtype: False)


def test_half_weights_are_read_as_half_by_the_widening_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    if build.library() is None:
        pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    _not_native(monkeypatch)
    calls: list[torch.dtype] = []
    real = widening_gemm.widening_gemm

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(w.dtype)
        return real(x, w, b)

    monkeypatch.setattr(layers.widening, "widening_gemm", spy)
    w = torch.nn.Parameter(torch.randn(40, 24).bfloat16(), requires_grad=False)
    assert upcasts_matmul(w) and multiplies_as_stored(w)
    x = torch.randn(200, 24, dtype=torch.bfloat16)
    out = linear(x, w, None)
    assert calls == [torch.bfloat16]  # the weight reached the kernel in bf16, no copy
    assert out.dtype == torch.bfloat16
    exact = F.linear(x.double(), w.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-4).all()
    assert not hasattr(layers, "_fp32_copies")


def test_without_kernels_each_call_multiplies_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    _not_native(monkeypatch)
    monkeypatch.setattr(widening_gemm, "takes", lambda weight: False)
    monkeypatch.setattr(layers.skinny, "applies", lambda x, weight: False)
    w = torch.randn(5, 3, dtype=torch.bfloat16)
    assert not multiplies_as_stored(w)
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    out = linear(x, w, None)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), w.float()).to(torch.bfloat16))


def test_native_half_matmul_keeps_half_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "half_is_native", lambda dtype: True)
    w = torch.randn(4, 3, dtype=torch.bfloat16)
    assert not upcasts_matmul(w) and multiplies_as_stored(w)
