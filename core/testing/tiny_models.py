"""Tiny random HF model folders (weights, config, tokenizer) for tests of every suite.

`make_tiny_model_dir(path, arch="llama")` writes what `transformers` itself would save: a
`config.json`, `model.safetensors` and a byte-level BPE tokenizer (`tokenizer.json`,
`tokenizer_config.json` with a small chat template). Weights come from `transformers`'
own initialisation under `torch.manual_seed(seed)`, so the same arguments give the same
model, and HF `generate` on the folder is the reference the engine is compared with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

# Special tokens appended after the 256 byte tokens; the model's vocabulary is exactly the
# tokenizer's, so every id the model can sample decodes.
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>")
BOS, EOS, UNK = SPECIAL_TOKENS[:3]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|user|>' if message['role'] == 'user' else '<|assistant|>' }}"
    "{{ message['content'] }}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Small enough to build in well under a second; a std above HF's 0.02 default keeps greedy
# logits apart, so comparisons with HF do not hinge on near ties.
_BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 16, "use_sliding_window": False},
    "mistral": {"sliding_window": None},
}


def make_tokenizer() -> Any:
    """A byte-level BPE tokenizer (256 byte tokens, no merges) plus `SPECIAL_TOKENS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=EOS
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model_dir(
    path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """Write a tiny random `arch` model and its tokenizer into `path`; return the folder.

    `overrides` replace config values (e.g. `num_hidden_layers=3`, `sliding_window=8`).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unknown tiny model arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}"
        )
    import transformers

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }[arch]
    config_cls, model_cls = (getattr(transformers, name) for name in names)
    values = {
        **_BASE_CONFIG,
        **_ARCH_DEFAULTS[arch],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **overrides,
    }
    config = config_cls(**values)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
