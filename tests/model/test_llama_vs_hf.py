"""Our CausalLM against HF transformers on tiny random models of every supported family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import LoadedModel, load_model

from .conftest import TINY_KINDS, PagedRunner, hf_logits, random_prompts, split_rows

PROMPT_LENGTHS = [7, 13, 3]  # longer and shorter than the sliding window (4)
ATOL = 1e-4

Models = dict[str, tuple[Path, Any]]


def _load(folder: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(str(folder), dtype=dtype, device="cpu")


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"{what}: max abs diff {diff:.3g} > {ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"{what}: argmax differs"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kind", list(TINY_KINDS))
def test_prefill_logits_match_hf(tiny_models: Models, kind: str, page_size: int) -> None:
    folder, hf = tiny_models[kind]
    loaded = _load(folder)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    out = PagedRunner(loaded.model, len(prompts), page_size=page_size).prefill(prompts)
    assert out.logits.dtype == torch.float32
    assert out.logits.shape == (sum(PROMPT_LENGTHS), loaded.arch.vocab_size)
    assert out.hidden_states is None
    for i, (prompt, ours) in enumerate(
        zip(prompts, split_rows(out.logits, PROMPT_LENGTHS), strict=True)
    ):
        _assert_close(ours, hf_logits(hf, prompt), f"{kind} prompt {i}")


@pytest.mark.parametrize("kind", list(TINY_KINDS))
def test_decode_steps_through_paged_cache_match_hf(tiny_models: Models, kind: str) -> None:
    folder, hf = tiny_models[kind]
    loaded = _load(folder)
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    runner = PagedRunner(loaded.model, len(prompts), page_size=4)
    out = runner.prefill(prompts, last_only=True)
    assert out.logits.shape == (len(prompts), loaded.arch.vocab_size)
    sequences = [list(p) for p in prompts]
    for step in range(2):  # the second step crosses a page boundary for the 7-token prompt
        next_tokens = out.logits.argmax(-1).tolist()
        for seq, token in zip(sequences, next_tokens, strict=True):
            seq.append(token)
        out = runner.decode(next_tokens)
        for i, seq in enumerate(sequences):
            _assert_close(out.logits[i], hf_logits(hf, seq)[-1], f"{kind} decode {step} req {i}")


def test_sliding_window_layers_are_read_from_the_config(tiny_models: Models) -> None:
    assert _load(tiny_models["qwen2_swa"][0]).arch.layer_sliding_window == (None, 4)
    assert _load(tiny_models["mistral_swa"][0]).arch.layer_sliding_window == (4, 4)
    assert _load(tiny_models["llama"][0]).arch.layer_sliding_window == (None, None)
    assert _load(tiny_models["gemma3"][0]).arch.layer_sliding_window == (4,) * 5 + (None,)


def test_logits_rows_and_captured_hidden_states(tiny_models: Models) -> None:
    folder, hf = tiny_models["qwen3"]
    model = _load(folder).model
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    out = PagedRunner(model, len(prompts), page_size=2).prefill(
        prompts, last_only=True, capture_hidden=True
    )
    assert out.hidden_states is not None
    assert out.hidden_states.shape == (len(prompts), model.arch.hidden_size)
    # The captured rows are pre-norm: norm + LM head on them reproduces the logits ...
    with torch.inference_mode():
        again = model.compute_logits(model.final_norm(out.hidden_states))
    torch.testing.assert_close(again, out.logits, rtol=0, atol=0)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt]), output_hidden_states=True)
        # ... and after the norm they equal HF's last hidden state (HF applies the norm).
        normed = model.final_norm(out.hidden_states[i])
        assert (normed - ref.hidden_states[-1][0, -1]).abs().max().item() <= ATOL
        _assert_close(out.logits[i], ref.logits[0, -1], f"last-token logits of prompt {i}")


def test_embed_and_tied_lm_head_are_shared(tiny_models: Models) -> None:
    model = _load(tiny_models["qwen3"][0]).model  # tied embeddings
    assert model.lm_head_weight is model.embed_tokens.weight
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(model.embed(ids), model.embed_tokens.weight[ids])
    untied = _load(tiny_models["llama"][0]).model
    assert untied.lm_head_weight is not untied.embed_tokens.weight


def test_weights_are_frozen_for_inference(tiny_models: Models) -> None:
    model = _load(tiny_models["llama"][0]).model
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


# qwen3's head_dim 32 runs the bf16 prefill attention on AMX tiles where the CPU has them
# (plugserve.kernels.prefill_attention.amx_applies); llama's 16 runs SDPA or the vector kernel.
@pytest.mark.parametrize("kind", ["llama3_rope_bias", "qwen3"])
def test_bfloat16_model_tracks_float32(tiny_models: Models, kind: str) -> None:
    folder, _ = tiny_models[kind]
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _load(folder, dtype).model
        assert model.embed_tokens.weight.dtype == dtype
        results[dtype] = PagedRunner(model, len(prompts), page_size=4).prefill(prompts).logits
    assert results[torch.bfloat16].dtype == torch.float32  # vocab logits always float32
    scale = results[torch.float32].abs().max().item()
    diff = (results[torch.bfloat16] - results[torch.float32]).abs().max().item()
    assert diff < 0.1 * scale, f"bf16 drifted {diff:.3g} from fp32 (logit scale {scale:.3g})"
