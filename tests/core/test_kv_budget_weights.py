"""The default KV pool's byte budget leaves room for the weights as they are held: on a
device whose memory is small next to the model, smaller (quantized) weights leave a bigger
pool."""

from __future__ import annotations

import pytest
import torch

from plugserve.mem import build
from plugserve.mem.build import DEFAULT_KV_BYTES, default_kv_bytes

GIB = 1 << 30


def test_budget_is_half_of_what_the_weights_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "device_memory_bytes", lambda device: 4 * GIB)
    cpu = torch.device("cpu")
    assert default_kv_bytes(cpu, 3 * GIB) == GIB // 2  # dense weights
    assert default_kv_bytes(cpu, GIB) == 3 * GIB // 2  # the same model quantized
    assert default_kv_bytes(cpu, 0) == DEFAULT_KV_BYTES  # capped
    assert default_kv_bytes(cpu, 5 * GIB) == 64 << 20  # never below the floor


def test_unknown_device_memory_keeps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "device_memory_bytes", lambda device: None)
    assert default_kv_bytes(torch.device("cpu"), 10 * GIB) == DEFAULT_KV_BYTES
