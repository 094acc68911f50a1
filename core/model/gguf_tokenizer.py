"""Building a Tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, used by SmolLM, Llama 3,
Qwen) are rebuilt directly with the `tokenizers` library: vocabulary, merges, the
pre-tokenizer split named by `tokenizer.ggml.pre`, and the control tokens as special tokens.
Other tokenizer models (e.g. SentencePiece "llama") are converted by transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from plugserve.model.errors import ModelLoadError
from plugserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types
_CONTROL = 3
_USER_DEFINED = 4

# Split patterns of the byte-level pre-tokenizers that differ from GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact"})
_PATTERN_OF_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_GPT2_PRES = frozenset({"gpt2", "default"})


def _pre_tokenizer(pre: str | None) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in _PATTERN_OF_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PATTERN_OF_PRE[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre is not None and pre not in _GPT2_PRES:
        logger.warning(
            "GGUF pre-tokenizer %r is not known; splitting text the GPT-2 way (known: %s)",
            pre, ", ".join(sorted(_GPT2_PRES | _DIGIT_SPLIT_PRES | set(_PATTERN_OF_PRE))),
        )
    return byte_level


def _byte_level_bpe(
    metadata: Mapping[str, Any], add_bos: bool, bos: str | None
) -> tokenizers.Tokenizer:
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
    pre = metadata.get("tokenizer.ggml.pre")
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab[bos])],
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL
    ])
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED
    ])
    return backend


def _backend_via_transformers(path: Path) -> tokenizers.Tokenizer:
    try:
        from transformers import AutoTokenizer

        converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return converted.backend_tokenizer
    except Exception as exc:
        raise ModelLoadError(f"{path}: transformers could not build its tokenizer: {exc}") from exc


def tokenizer_from_gguf(metadata: Mapping[str, Any], path: Path) -> Tokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    tokens: Sequence[str] | None = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ModelLoadError(f"{path}: the GGUF carries no tokenizer (tokenizer.ggml.* missing)")

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None or not 0 <= int(token_id) < len(tokens):
            return None
        return tokens[int(token_id)]

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, add_bos, token("bos"))
    else:
        backend = _backend_via_transformers(path)
    eos_keys = [f"tokenizer.ggml.{key}_token_id" for key in ("eos", "eot", "eom")]
    eos_ids = [int(metadata[key]) for key in eos_keys if metadata.get(key) is not None]
    return Tokenizer(
        backend,
        special_tokens={
            "bos_token": token("bos"), "eos_token": token("eos"),
            "unk_token": token("unknown"), "pad_token": token("padding"),
        },
        eos_token_ids=eos_ids,
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )
