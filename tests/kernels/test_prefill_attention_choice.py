"""Which prefill attention the torch_native backend runs on the CPU: the compiled kernels, or
SDPA for bf16 (fp16) where the CPU has AMX-BF16 (AMX-FP16), SDPA's flash attention
multiplies on the tiles and the AMX kernel does not apply (`prefill_attention.sdpa_is_faster`).
The CPU's flags and whether the AMX kernel applies are replaced in these tests, so every
answer is checked on any machine."""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.base import AttentionContext
from plugserve.attention.torch_native import TorchNativeBackend
from plugserve.kernels import isa
from plugserve.kernels import prefill_attention as pa


def _with_flags(monkeypatch: pytest.MonkeyPatch, flags: set[str], amx_kernel: bool = False) -> None:
    monkeypatch.setattr(isa, "has_cpu_flag", lambda flag: flag in flags)
    monkeypatch.setattr(pa, "amx_applies", lambda dtype, head_dim: amx_kernel)


@pytest.mark.parametrize(
    ("flags", "dtype", "faster"),
    [
        ({"amx_bf16"}, torch.bfloat16, True),
        ({"amx_bf16"}, torch.float16, False),
        ({"amx_bf16", "amx_fp16"}, torch.float16, True),
        ({"amx_bf16", "amx_fp16"}, torch.float32, False),
        ({"avx512_bf16"}, torch.bfloat16, False),
        (set(), torch.bfloat16, False),
    ],
)
def test_sdpa_is_faster_only_for_half_on_amx(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], dtype: torch.dtype, faster: bool
) -> None:
    _with_flags(monkeypatch, flags)
    assert pa.sdpa_is_faster(dtype, 64) is faster


@pytest.mark.parametrize("amx_kernel", [True, False])
def test_the_amx_kernel_beats_sdpa_where_it_applies(
    monkeypatch: pytest.MonkeyPatch, amx_kernel: bool
) -> None:
    _with_flags(monkeypatch, {"amx_bf16"}, amx_kernel)
    assert pa.sdpa_is_faster(torch.bfloat16, 64) is not amx_kernel


def _backend(dtype: torch.dtype) -> TorchNativeBackend:
    ctx = AttentionContext(
        num_heads=9, num_kv_heads=3, head_dim=64, page_size=1, max_batch_size=4,
        context_len=256, dtype=dtype, device=torch.device("cpu"),
    )
    return TorchNativeBackend(ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_keeps_the_kernel_without_amx(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    if not pa.available() or pa.isa() == "none":
        pytest.skip("the vector prefill kernel is not built on this machine")
    _with_flags(monkeypatch, {"avx512_bf16"})
    assert _backend(dtype).prefill_kernel


def test_the_backend_runs_sdpa_for_bf16_on_amx_without_the_amx_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not pa.available() or pa.isa() == "none":
        pytest.skip("the vector prefill kernel is not built on this machine")
    _with_flags(monkeypatch, {"amx_bf16"})
    assert not _backend(torch.bfloat16).prefill_kernel
    assert _backend(torch.float32).prefill_kernel


def test_the_backend_runs_the_kernel_for_bf16_where_the_amx_kernel_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not pa.available() or pa.isa() == "none":
        pytest.skip("the vector prefill kernel is not built on this machine")
    _with_flags(monkeypatch, {"amx_bf16"}, amx_kernel=True)
    assert _backend(torch.bfloat16).prefill_kernel
