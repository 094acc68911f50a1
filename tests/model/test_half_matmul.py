"""bf16/fp16 matmuls on CPUs without native half kernels multiply in float32."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from plugserve.kernels import packed_linear
from plugserve.kernels.packed_linear import upcasts_matmul
from plugserve.model import layers
from plugserve.model.layers import linear, matmul_weight


def test_fp32_weights_are_used_as_they_are() -> None:
    w = torch.randn(4, 3)
    assert not upcasts_matmul(w)
    assert matmul_weight(w) is w


def test_half_weight_copy_follows_in_place_writes_and_dies_with_the_weight() -> None:
    mp = pytest.MonkeyPatch()
    mp.setattr(packed_linear, "half_is_native", lambda dtype: False)
    try:
        w = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.bfloat16))
        first = matmul_weight(w)
        assert first.dtype == torch.float32 and matmul_weight(w) is first
        with torch.no_grad():
            w.mul_(2)
        again = matmul_weight(w)
        assert again is not first and torch.equal(again, w.detach().float())
        x = torch.randn(2, 3, dtype=torch.bfloat16)
        out = linear(x, w, None)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, F.linear(x.float(), w.detach().float()).to(torch.bfloat16))
        key = id(w)
        assert key in layers._fp32_copies
        del w, first, again
        gc.collect()
        assert key not in layers._fp32_copies
    finally:
        mp.undo()


def test_native_half_matmul_keeps_half_weights() -> None:
    mp = pytest.MonkeyPatch()
    mp.setattr(packed_linear, "half_is_native", lambda dtype: True)
    try:
        w = torch.randn(4, 3, dtype=torch.bfloat16)
        assert matmul_weight(w) is w
    finally:
        mp.undo()
