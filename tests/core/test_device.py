"""`device_problems`: why a device string cannot be used on this machine.

CUDA's presence is faked (torch.cuda.is_available / device_count), so every case runs on a
CPU-only machine; the last test checks the real machine's answer for 'cpu' and 'cuda'.
"""

from __future__ import annotations

import pytest
import torch

from plugserve.device import allowed_devices, device_problems


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int, cuda_version: str | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.version, "cuda", cuda_version)


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_cpu_is_always_usable(device: str) -> None:
    assert device_problems(device) == []


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:-1", "CUDA", "cuda:", " cpu", "mps"])
def test_malformed_device(device: str) -> None:
    assert device_problems(device) == [f"device must be 'cpu' or 'cuda[:N]', got {device!r}"]


def test_cpu_with_another_index() -> None:
    (problem,) = device_problems("cpu:1")
    assert "'cpu:1'" in problem and "allowed: 'cpu'" in problem


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_a_cpu_only_build(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    fake_cuda(monkeypatch, 0, None)
    (problem,) = device_problems(device)
    assert problem == (
        f"device {device!r} was requested but CUDA is not available: this PyTorch build "
        f"({torch.__version__}) has no CUDA support; allowed here: 'cpu'"
    )


def test_cuda_build_without_a_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 0, "12.8")
    (problem,) = device_problems("cuda")
    assert problem.startswith("device 'cuda' was requested but CUDA is not available: no CUDA "
                              "device is visible to PyTorch ")
    assert "(CUDA 12.8)" in problem and problem.endswith("allowed here: 'cpu'")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_visible_cuda_devices_are_usable(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    fake_cuda(monkeypatch, 2, "12.8")
    assert device_problems(device) == []


def test_cuda_index_past_the_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 2, "12.8")
    assert device_problems("cuda:2") == [
        "device 'cuda:2' names CUDA device 2, but only 2 are visible; allowed here: "
        "'cpu', 'cuda', 'cuda:0', 'cuda:1'"
    ]
    fake_cuda(monkeypatch, 1, "12.8")
    assert device_problems("cuda:5") == [
        "device 'cuda:5' names CUDA device 5, but only 1 is visible; allowed here: "
        "'cpu', 'cuda', 'cuda:0'"
    ]


def test_allowed_devices() -> None:
    assert allowed_devices(0) == ["cpu"]
    assert allowed_devices(2) == ["cpu", "cuda", "cuda:0", "cuda:1"]


def test_this_machine() -> None:
    assert device_problems("cpu") == []
    assert (device_problems("cuda") == []) == torch.cuda.is_available()
