"""The Tokenizer wrapper: encode/decode, BOS handling, chat templates, stop tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.model.chat_template import ChatTemplateError
from plugserve.model.tokenizer import Tokenizer

from .conftest import byte_level_tokenizer

MESSAGES = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye ✓"},
]


def _saved(tmp_path: Path, tokenizer: Tokenizer | None = None) -> Path:
    (tokenizer or byte_level_tokenizer()).save_hf_files(tmp_path)
    return tmp_path


def test_round_trip_and_special_ids(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_folder(_saved(tmp_path))
    text = "plain text, ünïcode ✓ and 42"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no BOS
    assert all(i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.bos_token_id == 256 and tok.eos_token_ids == frozenset({257})
    assert tok.vocab_size == 260
    assert tok.token_to_id("<|assistant|>") == 259
    assert tok.convert_tokens_to_ids("</s>") == 257
    assert tok.token_to_id("<|not a token|>") is None
    with_eos = [*tok.encode("A"), 257, *tok.encode("B")]
    assert tok.decode(with_eos) == "AB"
    assert tok.decode(with_eos, skip_special_tokens=False) == "A</s>B"


def test_extra_eos_ids_are_merged(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_folder(_saved(tmp_path), eos_token_ids=[258])
    assert tok.eos_token_ids == frozenset({257, 258})


def test_bos_added_only_when_the_tokenizer_says_so(tmp_path: Path) -> None:
    base = byte_level_tokenizer()
    with_bos = Tokenizer(base.backend, special_tokens=base.special_tokens, add_bos_token=True)
    assert with_bos.encode("ab") == [256, *base.encode("ab")]
    # The flag survives a save and a reload.
    assert Tokenizer.from_hf_folder(_saved(tmp_path, with_bos)).encode("ab")[0] == 256


def test_chat_template_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = _saved(tmp_path)
    ours = Tokenizer.from_hf_folder(folder)
    theirs: Any = AutoTokenizer.from_pretrained(str(folder))
    expected_text = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(MESSAGES) == expected_text
    assert expected_text.startswith("<s><|user|>Hi there</s>")
    ids = ours.apply_chat_template(MESSAGES)
    assert ids == list(
        theirs.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert ids.count(256) == 1 and ids[-1] == 259  # one BOS (from the template), ends on prompt
    assert ours.encode("hi") == theirs.encode("hi")


def test_chat_template_errors_are_clear() -> None:
    base = byte_level_tokenizer()
    no_template = Tokenizer(base.backend, special_tokens=base.special_tokens)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template(MESSAGES)
    strict = Tokenizer(
        base.backend,
        special_tokens=base.special_tokens,
        chat_template="{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('first message must be system') }}{% endif %}",
    )
    with pytest.raises(ChatTemplateError, match="first message must be system"):
        strict.apply_chat_template(MESSAGES)


def test_template_file_wins_over_config_entry(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    (folder / "chat_template.jinja").write_text("{{ messages | length }} messages")
    assert Tokenizer.from_hf_folder(folder).render_chat(MESSAGES) == "3 messages"
