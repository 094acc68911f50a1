"""FlashInfer's `auto` backend choice, modelled on CPU (`reference.determine_attention_backend`
and the wrapper's resolve-at-first-plan, read from flashinfer-python 0.7.2's prefill.py and
utils.py): no masked plan may reach a wrapper that resolved to fa3, whatever order extends
and tree verifies come in. The fix toggle `flashinfer_shared_prefill_wrapper` puts the shared
prefill wrapper back and the same batches crash as on an H100 (an extend, then a verify).

Also: every plan and run happens with the backend's device current (`cuda:N`, N != 0)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from plugserve.testing.paged_cases import Cases, Shape, native, run_backend
from plugserve_attention_flashinfer import backend as backend_module
from plugserve_attention_flashinfer import reference
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend
from plugserve_attention_flashinfer.fixes import SHARED_PREFILL_WRAPPER

# An H100-like case: bf16, head_dim 128 (FA3 instantiates 64/128/256), GQA.
SHAPE = Shape(page_size=16, num_heads=4, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "SIMULATED_SM90", True)


def test_the_model_follows_flashinfer() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert reference.determine_attention_backend(True, False, bf16, bf16, 128) == "fa3"
    assert reference.determine_attention_backend(True, True, bf16, bf16, 128) == "fa2"  # mask
    assert reference.determine_attention_backend(False, False, bf16, bf16, 128) == "fa2"
    assert reference.determine_attention_backend(True, False, bf16, bf16, 96) == "fa2"
    assert reference.determine_attention_backend(True, False, fp32, fp32, 128) == "fa2"


def test_an_auto_wrapper_keeps_its_first_choice(sm90: None) -> None:
    wrapper = reference.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(1))
    indptr, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    pages = torch.tensor([0], dtype=torch.int32)
    wrapper.plan(indptr, indptr, pages, last, 4, 2, 128, 16, causal=True,
                 q_data_type=torch.bfloat16)
    assert wrapper.backend == "fa3"
    wrapper.plan(indptr, indptr, pages, last, 4, 2, 128, 16,
                 custom_mask=torch.ones(1, dtype=torch.bool), q_data_type=torch.bfloat16)
    assert wrapper.backend == "fa3"  # kept: the masked run below is what FlashInfer refuses
    cache = torch.zeros(1, 16, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(reference.MaskedFa3Error):
        wrapper.run(torch.zeros(1, 4, 128, dtype=torch.bfloat16), (cache, cache))


def _batches(cases: Cases, verify_first: bool) -> list[Any]:
    extend = cases.extend(SHAPE, prefix_lens=[0, 19], extend_lens=[21, 5])
    verify = cases.extend(SHAPE, prefix_lens=[7, 30], extend_lens=[6, 4], tree_mask=True)
    return [verify, extend, verify] if verify_first else [extend, verify, extend]


def _run(cases: Cases, reverts: tuple[str, ...], verify_first: bool) -> FlashInferAttentionBackend:
    backend = FlashInferAttentionBackend(SHAPE.context(cases.device), kernels=reference,
                                         revert_fixes=reverts)
    for fb in _batches(cases, verify_first):
        q = cases.randn(fb.num_tokens, SHAPE.num_heads, SHAPE.head_dim, dtype=SHAPE.dtype)
        got = run_backend(backend, fb, q, SHAPE)
        assert (got.float() - native(fb, q, SHAPE).float()).abs().max() <= 2e-2
    return backend


@pytest.mark.parametrize("verify_first", [False, True], ids=["extend-first", "verify-first"])
def test_no_masked_plan_reaches_an_fa3_wrapper(sm90: None, cases: Cases,
                                               verify_first: bool) -> None:
    backend = _run(cases, (), verify_first)
    kinds = {key[0]: wrapper.backend for key, wrapper in backend._wrappers.items()}
    assert kinds == {"prefill": "fa3", "prefill_masked": "fa2"}  # extends keep the fast path
    for wrapper in backend._wrappers.values():
        assert not (wrapper.backend == "fa3" and wrapper.masks is not None)


def test_the_shared_wrapper_crashes_the_first_verify_after_an_extend(sm90: None,
                                                                     cases: Cases) -> None:
    with pytest.raises(reference.MaskedFa3Error):
        _run(cases, (SHARED_PREFILL_WRAPPER,), verify_first=False)


def test_plans_and_runs_happen_on_the_backends_device(monkeypatch: pytest.MonkeyPatch,
                                                      cases: Cases) -> None:
    current: list[str] = []

    @contextlib.contextmanager
    def scope(device: torch.device | str) -> Iterator[None]:
        current.append(str(device))
        yield
        current.pop()

    def on_device(method: Any) -> Any:
        def checked(*args: Any, **kwargs: Any) -> Any:
            assert current, "a FlashInfer call outside the backend's device scope"
            return method(*args, **kwargs)
        return checked

    class Prefill(reference.BatchPrefillWithPagedKVCacheWrapper):
        plan = on_device(reference.BatchPrefillWithPagedKVCacheWrapper.plan)
        run = on_device(reference.BatchPrefillWithPagedKVCacheWrapper.run)

    class Decode(reference.BatchDecodeWithPagedKVCacheWrapper):
        plan = on_device(reference.BatchDecodeWithPagedKVCacheWrapper.plan)
        run = on_device(reference.BatchDecodeWithPagedKVCacheWrapper.run)

    kernels = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=Prefill,
                              BatchDecodeWithPagedKVCacheWrapper=Decode, WORKSPACE_BYTES=16)
    monkeypatch.setattr(backend_module, "cuda_device_scope", scope)
    shape = Shape(4)
    backend = FlashInferAttentionBackend(shape.context(cases.device), kernels=kernels)
    for fb in (cases.extend(shape, [3], [5]), cases.decode(shape, [9, 2])):
        q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim, dtype=shape.dtype)
        run_backend(backend, fb, q, shape)
    assert current == []
