"""Logprobs as OpenAI and vLLM documents.

- completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
  each `top_logprobs` entry a dict of token text -> logprob holding the N most likely tokens
  and the chosen one (vLLM's shape: up to N + 1 entries); with `echo` the prompt's tokens
  come first, the first with `null` logprob and `null` alternatives.
- chat (`logprobs: true`, `top_logprobs: N`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`.
- vLLM's `prompt_logprobs`: per prompt token `null` (the first) or a dict of token id (as a
  string) -> `{"logprob", "rank", "decoded_token"}` with the prompt's token and the N most
  likely; `rank` is the token's place among the alternatives (1 = most likely), `null` when
  it is not among the N.

Token texts are each token decoded alone with special tokens kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Top = list[tuple[int, float]]


class TokenText:
    """Token id -> its text, cached (a server decodes the same ids again and again)."""

    def __init__(self, decode: Callable[..., str]) -> None:
        self.decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self.decode([token], skip_special_tokens=False)
            if len(self._cache) < 1 << 16:
                self._cache[token] = text
        return text


def completion_logprobs(text_of: TokenText, ids: Sequence[int],
                        logprobs: Sequence[float | None], tops: Sequence[Top | None] | None,
                        offset: int) -> dict[str, Any]:
    tokens = [text_of(t) for t in ids]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top_docs: list[dict[str, float] | None] = []
    for k, (token, lp) in enumerate(zip(ids, logprobs, strict=True)):
        if lp is None:
            top_docs.append(None)
            continue
        alternatives = tops[k] if tops is not None else None
        doc = {text_of(t): v for t, v in (alternatives or [])}
        doc.setdefault(text_of(token), lp)
        top_docs.append(doc)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_docs,
            "text_offset": offsets}


def chat_logprobs(text_of: TokenText, ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Top] | None) -> dict[str, Any]:
    def entry(token: int, lp: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for k, (token, lp) in enumerate(zip(ids, logprobs, strict=True)):
        item = entry(token, lp)
        item["top_logprobs"] = [entry(t, v) for t, v in (tops[k] if tops is not None else [])]
        content.append(item)
    return {"content": content}


def vllm_prompt_logprobs(text_of: TokenText, ids: Sequence[int],
                         values: Sequence[float | None], tops: Sequence[Top | None]
                         ) -> list[dict[str, dict[str, Any]] | None]:
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, value, top in zip(ids, values, tops, strict=True):
        if value is None:
            out.append(None)
            continue
        ranked = [t for t, _ in (top or [])]
        doc = {str(token): {"logprob": value,
                            "rank": ranked.index(token) + 1 if token in ranked else None,
                            "decoded_token": text_of(token)}}
        for rank, (t, v) in enumerate(top or [], start=1):
            doc.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text_of(t)})
        out.append(doc)
    return out
