"""Every call the backend makes to FlashInfer, bound against the pinned flashinfer-python's
real signatures (read from its wheel's source with `ast`: downloaded once, cached under the
user cache dir; skipped with the reason when it cannot be fetched), with the dtypes, devices
and layouts its docstrings ask for. Also the facts of FlashInfer's `auto` choice that the
CPU model (`reference.determine_attention_backend`) relies on. No GPU, a few seconds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from plugserve.testing.api_check import Recorder, signature_in
from plugserve.testing.paged_cases import Cases, Shape, run_backend
from plugserve.testing.wheels import WheelUnavailable, cached_from_wheel, member
from plugserve_attention_flashinfer import reference
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend
from plugserve_attention_flashinfer.environment import PINNED_FLASHINFER

SOURCES = ("prefill.py", "decode.py", "utils.py")


@pytest.fixture(scope="module")
def source() -> dict[str, str]:
    try:
        files = cached_from_wheel("flashinfer-python", PINNED_FLASHINFER,
                                  {name: member(f"flashinfer/{name}") for name in SOURCES})
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
    return {name: path.read_text() for name, path in files.items()}


def _recorded_run(cases: Cases) -> Recorder:
    recorder = Recorder()

    def wrapper_class(base: type, prefix: str) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            recorder.wrap(f"{prefix}.__init__", lambda *a, **k: None)(*args, **kwargs)
            wrapper = base(*args, **kwargs)
            wrapper.plan = recorder.wrap(f"{prefix}.plan", wrapper.plan)
            wrapper.run = recorder.wrap(f"{prefix}.run", wrapper.run)
            return wrapper
        return make

    kernels = SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=wrapper_class(
            reference.BatchPrefillWithPagedKVCacheWrapper, "prefill"),
        BatchDecodeWithPagedKVCacheWrapper=wrapper_class(
            reference.BatchDecodeWithPagedKVCacheWrapper, "decode"),
        WORKSPACE_BYTES=16)
    shape = Shape(16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                  sliding_window=24)
    backend = FlashInferAttentionBackend(shape.context(cases.device), kernels=kernels)
    for fb in (cases.extend(shape, [0, 19], [21, 5]),
               cases.extend(shape, [7, 30], [6, 4], tree_mask=True),
               cases.decode(shape, [9, 40])):
        q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim, dtype=shape.dtype)
        run_backend(backend, fb, q, shape)
    return recorder


def _int32_host(t: Any, name: str) -> None:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu", (
        f"{name}: {getattr(t, 'dtype', t)} on {getattr(t, 'device', '?')}")


def test_every_call_binds_to_the_real_signature(source: dict[str, str], cases: Cases) -> None:
    calls = _recorded_run(cases)
    signatures = {
        "prefill.__init__": signature_in(source["prefill.py"],
                                         "BatchPrefillWithPagedKVCacheWrapper.__init__"),
        "prefill.plan": signature_in(source["prefill.py"],
                                     "BatchPrefillWithPagedKVCacheWrapper.plan"),
        "prefill.run": signature_in(source["prefill.py"],
                                    "BatchPrefillWithPagedKVCacheWrapper.run"),
        "decode.__init__": signature_in(source["decode.py"],
                                        "BatchDecodeWithPagedKVCacheWrapper.__init__"),
        # plan(indptr, ..., page_size, *deprecated, **kwargs) forwards the keywords here
        "decode.plan": signature_in(source["decode.py"],
                                    "BatchDecodeWithPagedKVCacheWrapper._plan_impl"),
        "decode.run": signature_in(source["decode.py"], "BatchDecodeWithPagedKVCacheWrapper.run"),
    }
    seen = {c.name for c in calls.calls}
    assert seen == set(signatures), seen
    for call in calls.calls:
        bound = signatures[call.name].bind("self", *call.args, **call.kwargs)
        args = bound.arguments
        if call.name.endswith("__init__"):
            assert args["kv_layout"] == "NHD"
            if call.name == "prefill.__init__":
                assert args["backend"] in ("auto", "fa2")
        elif call.name == "prefill.plan":
            for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"):
                _int32_host(args[name], name)
            assert args["paged_kv_indices"].dtype == torch.int32
            mask = args.get("custom_mask")
            assert mask is None or mask.dtype == torch.bool
        elif call.name == "decode.plan":
            for name in ("indptr", "last_page_len"):
                _int32_host(args[name], name)
            assert args["indices"].dtype == torch.int32
        else:  # run(q, paged_kv_cache): q [tokens, heads, dim], NHD pages
            q, (k_cache, v_cache) = args["q"], args["paged_kv_cache"]
            assert q.dim() == 3 and q.is_contiguous()
            assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            assert k_cache.shape[-1] == q.shape[-1] and k_cache.dtype == q.dtype


def test_the_auto_choice_the_model_relies_on(source: dict[str, str]) -> None:
    flat = {name: " ".join(text.split()) for name, text in source.items()}
    # An auto wrapper resolves at plan() and keeps the result in self._backend.
    assert ("if self._backend == \"auto\": self._backend = determine_attention_backend("
            in flat["prefill.py"])
    assert "self._custom_mask_buf is not None, # use_custom_mask" in flat["prefill.py"]
    # FA3: sm90 only, never with a custom mask, prefill head dims 64/128/256.
    assert "if use_custom_mask: return False" in flat["utils.py"]
    assert "return head_dim_qk in {64, 128, 256}" in flat["utils.py"]
    assert "def is_sm90a_supported(device: torch.device) -> bool: major, _ = " \
           "get_compute_capability(device) return major == 9" in flat["utils.py"]
