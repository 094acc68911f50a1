"""From engine events to OpenAI documents: incremental text, logprobs, choices, usage.

Text is decoded from all of a choice's tokens each time (so multi-byte characters split
across tokens come out whole); what was sent is never taken back. While a choice runs, a
trailing replacement character (an incomplete UTF-8 sequence) and, with stop strings, the
last `len(longest stop) - 1` characters are held back; the final text is cut at the stop
string exactly as `Engine.generate` cuts it, so a stream's pieces add up to the same text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plugserve.server.jobs import Event


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One prompt's output as it arrives."""

    index: int
    decode: Callable[..., str]
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent_text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def add(self, event: Event) -> tuple[str, list[int], list[float]]:
        """Take one event; the new text, token ids and logprobs it makes sendable."""
        if event.kind == "accepted":
            self.prompt_tokens = event.prompt_tokens
        new_ids = list(event.token_ids)
        self.token_ids += new_ids
        new_lp = list(event.logprobs or [])
        self.logprobs += new_lp
        text = self.decode(self.token_ids) if self.token_ids else ""
        if event.kind == "final":
            self.finish_reason = event.finish_reason
            self.error = event.error
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.cached_tokens = event.cached_tokens
            if event.stop_str and event.stop_str in text:
                text = text[: text.index(event.stop_str)]
        else:
            text = text.rstrip("\ufffd")
            hold = max((len(s) for s in self.stop), default=1) - 1
            if hold:
                text = text[: max(len(self.sent_text), len(text) - hold)]
        delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        self.sent_text += delta
        return delta, new_ids, new_lp

    @property
    def text(self) -> str:
        return self.sent_text


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(len(c.token_ids) for c in choices)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    cached = sum(c.cached_tokens for c in choices)
    out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def token_strings(decode: Callable[..., str], ids: list[int]) -> list[str]:
    return [decode([t], skip_special_tokens=False) for t in ids]


def completion_logprobs(
    decode: Callable[..., str], ids: list[int], logprobs: list[float], offset: int
) -> dict[str, Any]:
    """The legacy completions `logprobs` object (the sampled token only)."""
    tokens = token_strings(decode, ids)
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
            "text_offset": offsets}


def chat_logprobs(decode: Callable[..., str], ids: list[int], logprobs: list[float]
                  ) -> dict[str, Any]:
    return {"content": [
        {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
        for t, lp in zip(token_strings(decode, ids), logprobs, strict=True)
    ]}


class Documents:
    """Builds one HTTP request's response documents (full or streamed chunks)."""

    def __init__(self, kind: str, model: str, decode: Callable[..., str], *, logprobs: bool,
                 token_ids: bool) -> None:
        self.chat = kind == "chat"
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.decode = decode
        self.want_logprobs = logprobs
        self.want_token_ids = token_ids

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, ids: list[int], lps: list[float], offset: int) -> Any:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.decode, ids, lps)
        return completion_logprobs(self.decode, ids, lps, offset)

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        out = []
        for c in choices:
            item: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                    "logprobs": self._logprobs(c.token_ids, c.logprobs, 0)}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            if self.want_token_ids:
                item["token_ids"] = list(c.token_ids)
            out.append(item)
        return {**self._head(False), "choices": out, "usage": usage(choices)}

    def chunk(self, choice: Choice, text: str, ids: list[int], lps: list[float],
              finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        item: dict[str, Any] = {"index": choice.index, "finish_reason": finish_reason,
                                "logprobs": self._logprobs(
                                    ids, lps, len(choice.sent_text) - len(text))}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            item["delta"] = delta
        else:
            item["text"] = text
        if self.want_token_ids:
            item["token_ids"] = list(ids)
        return {**self._head(True), "choices": [item], "usage": None}

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage(choices)}
