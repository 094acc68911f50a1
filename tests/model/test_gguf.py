"""GGUF files written the way llama.cpp does load as the same model as the HF folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import load_model
from plugserve.model.default_model import converted_folder, ensure_converted
from plugserve.model.loader_gguf import undo_rope_permutation
from plugserve.model.rope import rope_inv_freq

from .conftest import (
    LLAMA3_ROPE,
    PagedRunner,
    dequantized_copy,
    hf_logits,
    random_prompts,
    rope_interleave,
    split_rows,
    write_tiny_gguf,
)

PROMPT_LENGTHS = [9, 4]
Models = dict[str, tuple[Path, Any]]


def _logits(path: Path, prompts: list[list[int]]) -> torch.Tensor:
    # float activations: the kept Q8_0 blocks multiply as their dequantized values
    model = load_model(str(path), dtype=torch.float32, device="cpu",
                       quant_activations="float").model
    return PagedRunner(model, len(prompts), page_size=4).prefill(prompts).logits


def test_undo_rope_permutation_inverts_the_converter() -> None:
    weight = torch.randn(3 * 8, 5)
    assert not torch.equal(rope_interleave(weight, 3), weight)
    assert torch.equal(undo_rope_permutation(rope_interleave(weight, 3), 3), weight)
    bias = torch.randn(3 * 8)
    assert torch.equal(undo_rope_permutation(rope_interleave(bias, 3), 3), bias)


@pytest.mark.parametrize("kind", ["llama", "llama3_rope_bias", "qwen3"])
def test_f32_gguf_gives_the_hf_folder_logits(
    tiny_models: Models, tmp_path: Path, kind: str
) -> None:
    folder, hf = tiny_models[kind]
    gguf_path = tmp_path / "tiny.gguf"
    rope_freqs = None
    if kind == "llama3_rope_bias":  # llama.cpp stores llama3 scaling as per-frequency divisors
        rope_freqs = rope_inv_freq(16, 10000.0, None) / rope_inv_freq(16, 10000.0, LLAMA3_ROPE)
    write_tiny_gguf(hf, gguf_path, rope_freqs=rope_freqs)
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    from_gguf = _logits(gguf_path, prompts)
    from_folder = _logits(folder, prompts)
    atol = 0.0 if rope_freqs is None else 1e-4
    torch.testing.assert_close(from_gguf, from_folder, rtol=0, atol=atol)
    assert torch.equal(from_gguf.argmax(-1), from_folder.argmax(-1))


def test_q8_gguf_matches_hf_with_the_dequantized_weights(
    tiny_models: Models, tmp_path: Path
) -> None:
    _, hf = tiny_models["llama"]
    gguf_path = tmp_path / "tiny-q8.gguf"
    write_tiny_gguf(hf, gguf_path, quant="Q8_0")
    reference = dequantized_copy(hf, "Q8_0")
    prompts = random_prompts(PROMPT_LENGTHS, seed=6)
    ours = split_rows(_logits(gguf_path, prompts), PROMPT_LENGTHS)
    for prompt, rows in zip(prompts, ours, strict=True):
        ref = hf_logits(reference, prompt)
        assert (rows - ref).abs().max().item() <= 1e-4
        assert torch.equal(rows.argmax(-1), ref.argmax(-1))


def test_gguf_tokenizer_and_metadata_match_the_hf_folder(
    tiny_models: Models, tmp_path: Path
) -> None:
    folder, hf = tiny_models["llama"]
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, gguf_path)
    a = load_model(str(gguf_path), dtype=torch.float32, device="cpu")
    b = load_model(str(folder), dtype=torch.float32, device="cpu")
    assert a.source == gguf_path and b.source == folder
    assert a.arch == b.arch
    text = "Hello, GGUF! 123 – ünïcode"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.decode(a.tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert a.tokenizer.apply_chat_template(messages) == b.tokenizer.apply_chat_template(messages)
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids == frozenset({257})


def test_gguf_to_hf_conversion_is_cached_and_atomic(tiny_models: Models, tmp_path: Path) -> None:
    _, hf = tiny_models["qwen3"]
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, gguf_path)
    cache = tmp_path / "cache"
    folder = ensure_converted(gguf_path, cache)
    assert folder == converted_folder(gguf_path, cache)
    assert {p.name for p in folder.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    }
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging left over
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_converted(gguf_path, cache) == folder  # second call reuses the folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    prompts = random_prompts(PROMPT_LENGTHS, seed=7)
    torch.testing.assert_close(
        _logits(folder, prompts), _logits(gguf_path, prompts), rtol=0, atol=0
    )
    # The converted folder is a real HF folder: transformers loads it as the same model.
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt in prompts:
        torch.testing.assert_close(hf_logits(reloaded, prompt), hf_logits(hf, prompt))


def test_converted_folder_changes_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    first = converted_folder(path, tmp_path)
    path.write_bytes(b"xy")
    assert converted_folder(path, tmp_path) != first


def test_gguf_of_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    import gguf

    from plugserve.model import UnsupportedArchitectureError

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match=r"phi2.*llama, qwen2, qwen3") as err:
        load_model(str(path), dtype=torch.float32, device="cpu")
    assert str(path) in str(err.value)
