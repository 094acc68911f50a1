"""`kv_cache_dtype`: the KV pools store bf16 / fp8 and attention reads them widened.

The engine with a narrower KV cache is token-identical to transformers with its K (after
rope) and V rounded to that dtype, logprobs within 1e-4 (fp32 weights; a prefix-cache hit
and chunked prefill; normal and overlap loop; the checker on). The pool's bytes per token set
its default size; a backend that does not declare the dtype is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from plugserve.attention.capabilities import TORCH_NATIVE_CAPABILITIES, BackendCapabilities
from plugserve.config import EngineConfig
from plugserve.pools.kv_pool import KVPool, kv_cache_torch_dtype, to_cache_dtype
from plugserve.registry import Entry, Registries
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts
from plugserve.validation import validate_config

NARROWER = ["bfloat16", "float8_e4m3", "float8_e5m2"]
TOL = 1e-4


@contextmanager
def rounded_kv(model: Any, dtype: torch.dtype) -> Iterator[None]:
    """transformers' Llama with every layer's K (after rope) and V rounded as a `dtype`
    cache stores them."""
    from transformers.models.llama import modeling_llama

    rope = modeling_llama.apply_rotary_pos_emb

    def stored(x: torch.Tensor) -> torch.Tensor:
        return to_cache_dtype(x, dtype).to(x.dtype)

    def rope_then_round(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        q, k = rope(q, k, *args, **kwargs)
        return q, stored(k)

    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: stored(out))
             for layer in model.model.layers]
    modeling_llama.apply_rotary_pos_emb = rope_then_round
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
        for hook in hooks:
            hook.remove()


def hf_logprobs(model: Any, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    with rounded_kv(model, dtype), torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", NARROWER)
class TestNarrowerKVCache(EngineTest):
    def test_matches_transformers_over_the_same_rounded_kv(
        self, tiny_model_dir: Path, kv_cache_dtype: str, overlap: bool
    ) -> None:
        from transformers import AutoModelForCausalLM

        prompts = random_prompts(3, 256, 20, 70, seed=4)
        prompts[1] = prompts[0][:40] + prompts[1][:12]  # a prefix-cache hit on prompt 0
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True)
        with self.engine(model=str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype, page_size=4,
                         chunked_prefill_size=16, overlap=overlap) as engine:
            stored = kv_cache_torch_dtype(kv_cache_dtype, torch.float32)
            assert engine.kv_pool.dtype == stored
            assert all(b.dtype == stored for b in engine.kv_pool.k_buffer.values())
            results = engine.generate(prompts[:1], sp)
            results += engine.generate(prompts[1:], sp)
            assert results[1].stats["cached_tokens"] >= 16
            self.assert_idle_memory_whole(engine)
        model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        for ids, result in zip(prompts, results, strict=True):
            ref = hf_logprobs(model, stored, ids + result.token_ids)
            for k, token in enumerate(result.token_ids):
                row = ref[len(ids) - 1 + k]
                assert token == int(row.argmax()), (kv_cache_dtype, k)
                assert result.logprobs[k] == pytest.approx(float(row[token]), abs=TOL)


def test_the_rounded_reference_is_not_the_full_precision_one(tiny_model_dir: Path) -> None:
    """The test above could not pass by accident: rounding K/V to fp8 moves transformers'
    logprobs by far more than its tolerance."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = random_prompts(1, 256, 40, 40, seed=4)[0]
    with torch.inference_mode():
        full = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    rounded = hf_logprobs(model, torch.float8_e5m2, ids)
    assert float((full - rounded).abs().max()) > 100 * TOL


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_stores_saturate_at_the_largest_finite_value(dtype: torch.dtype) -> None:
    """(torch's own cast makes e5m2 overflow infinite.)"""
    pool = KVPool(num_pages=2, page_size=1, layer_ids=[0], num_kv_heads=1, head_dim=2,
                  dtype=dtype, device="cpu")
    top = torch.finfo(dtype).max
    big = torch.tensor([[[1e6, -1e6]]])
    pool.set_kv(0, torch.tensor([1]), big, big / 15625)
    assert pool.get_k(0)[1].float().tolist() == [[top, -top]]
    assert pool.get_v(0)[1].float().tolist() == [[64.0, -64.0]]
    assert pool.get_k(0)[0].float().tolist() == [[0.0, 0.0]]  # nothing else written


def test_the_default_pool_holds_more_tokens_of_a_narrower_cache(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default pool is a byte budget: fp8 holds 4x the tokens of fp32, each token still
    one slot (accounting unchanged)."""
    from plugserve.engine import Engine

    monkeypatch.setattr("plugserve.mem.build.DEFAULT_KV_BYTES", 1 << 22)
    pages = {}
    for kv in ("auto", "bfloat16", "float8_e4m3"):
        with Engine(model=str(tiny_model_dir), kv_cache_dtype=kv) as engine:
            pages[kv] = engine.kv_pool.num_pages
    assert pages["float8_e4m3"] == 2 * pages["bfloat16"] == 4 * pages["auto"]


def _registries(caps: BackendCapabilities) -> Registries:
    regs = Registries()
    for name, c in (("torch_native", TORCH_NATIVE_CAPABILITIES), ("bare", caps)):
        regs.attention.add(Entry(kind="attention backend", name=name, loader=lambda: object,
                                 capabilities=c, plugin="test", distribution="plugserve-test",
                                 version="1.0"))
    regs.cache.add(Entry(kind="cache policy", name="radix", loader=lambda: object,
                         capabilities=None, plugin="test", distribution="plugserve-test",
                         version="1.0"))
    regs.spec.add(Entry(kind="speculative algorithm", name="none", loader=lambda: object,
                        capabilities=None, plugin="test", distribution="plugserve-test",
                        version="1.0"))
    return regs


def test_a_backend_reads_only_the_kv_cache_dtypes_it_declares() -> None:
    bare = BackendCapabilities(dtypes=frozenset({"float32", "bfloat16"}))
    assert bare.kv_cache_dtypes == frozenset({"auto"})  # the conservative default
    regs = _registries(bare)
    (reason,) = validate_config(EngineConfig(attention="bare", kv_cache_dtype="float8_e4m3"),
                                regs)
    assert "'bare' does not read a 'float8_e4m3' KV cache" in reason and "['auto']" in reason
    # "auto", or a dtype naming the model's own, needs nothing declared.
    assert validate_config(EngineConfig(attention="bare"), regs) == []
    assert validate_config(EngineConfig(attention="bare", dtype="bfloat16",
                                        kv_cache_dtype="bfloat16"), regs) == []
    assert validate_config(EngineConfig(attention="bare", kv_cache_dtype="float32"), regs) == []
    # float32 under a bf16 model is wider than the model: only a backend declaring it
    (reason,) = validate_config(EngineConfig(dtype="bfloat16", kv_cache_dtype="float32"), regs)
    assert "does not read a 'float32' KV cache" in reason
    for kv in NARROWER:
        assert validate_config(EngineConfig(kv_cache_dtype=kv), regs) == []  # torch_native


def test_the_option_is_checked_and_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    monkeypatch.setenv("PLUGSERVE_KV_CACHE_DTYPE", "float8_e5m2")
    assert EngineConfig().kv_cache_dtype == "float8_e5m2"
