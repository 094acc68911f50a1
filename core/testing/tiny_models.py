"""Tiny random HF model folders (weights, config, tokenizer) for tests of every suite.

`make_tiny_model_dir(path, arch="llama")` writes what `transformers` itself would save: a
`config.json`, `model.safetensors` and a byte-level BPE tokenizer (`tokenizer.json`,
`tokenizer_config.json` with a small chat template). Weights come from `transformers`'
own initialisation under `torch.manual_seed(seed)`, so the same arguments give the same
model, and HF `generate` on the folder is the reference the engine is compared with.

The `*_swa` archs and "gemma3" have sliding-window layers with windows of 16-24 tokens, so
test prompts and outputs cross them: "mistral_swa" windows every layer, "qwen2_swa" is hybrid
through `max_window_layers`, "qwen3_swa" through `layer_types`, and "gemma3" has Gemma 3's
5 local : 1 global layers. transformers starts Gemma's (1 + w) norm weights at w = 0; they
get small seeded noise, so a norm dropped or applied the Llama way changes the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# arch -> (transformers config class, model class)
_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM"),
    "qwen2_swa": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_swa": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
ARCHITECTURES = tuple(_CLASSES)
SLIDING_WINDOW_ARCHITECTURES = ("mistral_swa", "qwen2_swa", "qwen3_swa", "gemma3")

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
    "mistral_swa": {"sliding_window": 16},
    # layer 0 full, layers 1 and 2 windowed
    "qwen2_swa": {
        "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 24,
        "max_window_layers": 1,
    },
    "qwen3_swa": {
        "head_dim": 16, "num_hidden_layers": 3, "use_sliding_window": True,
        "sliding_window": 20,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    # layers 0-4 local (window 20, rope base 10k), layer 5 global (rope base 1M, linear x8)
    "gemma3": {
        "num_hidden_layers": 6, "head_dim": 32, "sliding_window": 20,
        "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "tie_word_embeddings": True,
    },
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
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[arch])
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
    if arch == "gemma3":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.2 * torch.randn(param.shape))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
