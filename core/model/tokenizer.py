"""Tokenizer: a thin wrapper over a `tokenizers.Tokenizer` plus the model's chat template.

It is read from an HF folder (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`) or built from GGUF metadata (`plugserve.model.gguf_tokenizer`), and can
write itself back as HF files. Whether `encode` adds BOS follows the model's own tokenizer:
an explicit `add_bos_token` setting wins, otherwise the tokenizer's post-processor decides.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from plugserve.model.chat_template import ChatTemplateError, render_chat_template
from plugserve.model.errors import ModelLoadError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _pick_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    json_file = folder / "chat_template.json"
    if template is None and json_file.is_file():
        template = _read_json(json_file).get("chat_template")
    return template if isinstance(template, str) else None


def _backend_via_transformers(folder: Path) -> tokenizers.Tokenizer:
    """For folders with only a slow (e.g. SentencePiece) tokenizer: let transformers convert."""
    try:
        from transformers import AutoTokenizer

        converted = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return converted.backend_tokenizer
    except Exception as exc:
        raise ModelLoadError(
            f"{folder}: no tokenizer.json, and transformers could not build a fast tokenizer "
            f"from the other tokenizer files: {exc}"
        ) from exc


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.bos_token_id = self._id_of_special("bos_token")
        eos = set(eos_token_ids)
        own_eos = self._id_of_special("eos_token")
        if own_eos is not None:
            eos.add(own_eos)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    def _id_of_special(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self.backend.token_to_id(token)

    # ---- reading and writing HF files ---------------------------------------------------

    @classmethod
    def from_hf_folder(cls, folder: str | Path, *, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        folder = Path(folder)
        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        special_map_file = folder / "special_tokens_map.json"
        special_map = _read_json(special_map_file) if special_map_file.is_file() else {}
        tokenizer_file = folder / "tokenizer.json"
        if tokenizer_file.is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
            except Exception as exc:
                raise ModelLoadError(f"{tokenizer_file}: cannot parse tokenizer: {exc}") from exc
        else:
            backend = _backend_via_transformers(folder)
        special = {
            key: _token_text(config.get(key)) or _token_text(special_map.get(key))
            for key in _SPECIAL_TOKEN_KEYS
        }
        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=eos_token_ids,
            chat_template=_pick_chat_template(folder, config),
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
        )

    def save_hf_files(self, folder: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        if self.add_bos_token is not None:
            config["add_bos_token"] = self.add_bos_token
        if self.add_eos_token is not None:
            config["add_eos_token"] = self.add_eos_token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            (folder / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    # ---- use -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model may have more rows)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`, with BOS (or EOS) only where the model's tokenizer adds them."""
        if self.add_bos_token is None and self.add_eos_token is None:
            return list(self.backend.encode(text, add_special_tokens=True).ids)
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        eos = self._id_of_special("eos_token")
        if self.add_eos_token and eos is not None:
            ids.append(eos)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text the chat template makes of `messages` (and `tools`, OpenAI's
        list, which HF templates take as `tools`)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template; send a plain text prompt instead "
                "of chat messages"
            )
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens, tools=tools,
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template itself supplies any BOS."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools)
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def token_to_id(self, token: str) -> int | None:
        """Id of one token string (e.g. a stop token), or None when the vocabulary lacks it."""
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.token_to_id(token)
