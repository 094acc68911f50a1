"""From engine events to OpenAI documents: incremental text, logprobs, choices, usage.

While a choice runs its text grows by a few tokens' decoding per event
(`plugserve.detokenize`: decoding all of its tokens each time costs time in the square of
the stream's length), and its final text is decoded from all of its tokens once; what was
sent is never taken back. While a choice runs, a trailing replacement character (an
incomplete UTF-8 sequence) and, with stop strings, the last `len(longest stop) - 1`
characters are held back; the final text is cut at the stop string exactly as
`Engine.generate` cuts it (kept with `include_stop_str_in_output`), so a stream's pieces add
up to the same text. With `echo` the prompt's text (and logprobs) comes first: the whole
text of a response, the first chunk of a stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plugserve.detokenize import IncrementalText
from plugserve.outputs import cut_at_stop
from plugserve.server.jobs import Event
from plugserve.server.logprob_docs import (
    TokenText,
    Top,
    chat_logprobs,
    completion_logprobs,
    vllm_prompt_logprobs,
)
from plugserve.server.tool_output import ToolAnswer, ToolMode


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Delta:
    """What one event made sendable for one choice."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[Top] | None


@dataclass
class Choice:
    """One prompt's output as it arrives."""

    index: int
    render: Callable[[list[int]], str]  # token ids -> text (the request's special-token rule)
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    keep_tokens: bool = True  # False: max_tokens 0 (the one sampled token is not returned)
    prompt_ids: list[int] = field(default_factory=list)
    counts_prompt: bool = True  # n > 1: only a prompt's first sample counts it in usage
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Top] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[Top | None] | None = None
    sent_text: str = ""
    echoed: str | None = None  # the prompt's text, once rendered for echo
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    running_text: IncrementalText = field(init=False, repr=False)  # of token_ids, as they grow

    def __post_init__(self) -> None:
        self.running_text = IncrementalText(self.render)

    def add(self, event: Event) -> Delta:
        """Take one event; the new text, token ids and logprobs it makes sendable."""
        if event.kind == "accepted":
            self.prompt_tokens = event.prompt_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
            self.prompt_top_logprobs = event.prompt_top_logprobs
        new_ids = list(event.token_ids) if self.keep_tokens else []
        new_lp = list(event.logprobs or []) if self.keep_tokens else []
        new_top = list(event.top_logprobs) if event.top_logprobs is not None \
            and self.keep_tokens else None
        self.token_ids += new_ids
        self.logprobs += new_lp
        self.top_logprobs += new_top or []
        if event.kind == "final":
            self.finish_reason = event.finish_reason
            self.error = event.error
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.cached_tokens = event.cached_tokens
            text = self.render(self.token_ids) if self.token_ids else ""
            text = cut_at_stop(text, event.stop_str, self.include_stop)
        else:
            text = self.running_text.text(self.token_ids).rstrip("\ufffd")
            hold = max((len(s) for s in self.stop), default=1) - 1
            if hold:
                text = text[: max(len(self.sent_text), len(text) - hold)]
        delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        self.sent_text += delta
        return Delta(delta, new_ids, new_lp, new_top)

    @property
    def text(self) -> str:
        return self.sent_text

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def best_choices(choices: list[Choice], n: int, per_prompt: int) -> list[Choice]:
    """best_of > n: per prompt, the n samples of the highest cumulative logprob (ties: the
    lower sample first), indexed prompt_i * n + rank as OpenAI does."""
    if per_prompt == n:
        return choices
    out: list[Choice] = []
    for start in range(0, len(choices), per_prompt):
        group = choices[start:start + per_prompt]
        ranked = sorted(group, key=lambda c: -sum(c.logprobs))[:n]
        for rank, choice in enumerate(ranked):
            choice.index, choice.counts_prompt = len(out), rank == 0
            out.append(choice)
    return out


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Prompt tokens once per prompt (however many samples it has), completions summed."""
    prompt = sum(c.prompt_tokens for c in choices if c.counts_prompt)
    completion = sum(c.completion_tokens for c in choices)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    cached = sum(c.cached_tokens for c in choices if c.counts_prompt)
    out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


class Documents:
    """Builds one HTTP request's response documents (full or streamed chunks)."""

    def __init__(self, kind: str, model: str, decode: Callable[..., str], *, logprobs: bool,
                 token_ids: bool, echo: bool = False, prompt_logprobs: bool = False,
                 skip_special_tokens: bool = True, tools: ToolMode | None = None) -> None:
        self.chat = kind == "chat"
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.decode = decode
        self.text_of = TokenText(decode)
        self.want_logprobs = logprobs
        self.want_token_ids = token_ids
        self.echo = echo
        self.want_prompt_logprobs = prompt_logprobs
        self.skip_special = skip_special_tokens
        self.tools = tools
        self._tool_answers: dict[int, ToolAnswer] = {}

    def _tool_answer(self, choice: Choice) -> ToolAnswer | None:
        if self.tools is None or not self.chat:
            return None
        return self._tool_answers.setdefault(choice.index, ToolAnswer(self.tools))

    def render(self, ids: list[int]) -> str:
        if self.skip_special:
            return str(self.decode(ids))
        return str(self.decode(ids, skip_special_tokens=False))

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, ids: list[int], lps: list[float], tops: list[Top] | None,
                  offset: int, prompt: Choice | None = None) -> Any:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.text_of, ids, lps, tops)
        if prompt is None:
            return completion_logprobs(self.text_of, ids, lps, tops, offset)
        values = prompt.prompt_logprobs or [None] * len(prompt.prompt_ids)
        prompt_tops = prompt.prompt_top_logprobs or [None] * len(prompt.prompt_ids)
        all_tops: list[Top | None] = [*prompt_tops, *(tops or [None] * len(ids))]
        return completion_logprobs(self.text_of, [*prompt.prompt_ids, *ids],
                                   [*values, *lps], all_tops, offset)

    def _prompt_logprobs_doc(self, choice: Choice) -> Any:
        if not self.want_prompt_logprobs or choice.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.text_of, choice.prompt_ids, choice.prompt_logprobs,
                                    choice.prompt_top_logprobs or [])

    def echo_text(self, choice: Choice) -> str:
        if not self.echo:
            return ""
        if choice.echoed is None:
            choice.echoed = self.render(choice.prompt_ids)
        return choice.echoed

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        out = []
        for c in choices:
            echo = c if self.echo else None
            item: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                    "logprobs": self._logprobs(c.token_ids, c.logprobs,
                                                               c.top_logprobs or None, 0, echo)}
            answer = self._tool_answer(c)
            if answer is not None:
                content, calls, item["finish_reason"] = answer.full(c.text, c.finish_reason)
                item["message"] = {"role": "assistant", "content": content}
                if calls:
                    item["message"]["tool_calls"] = [call.document() for call in calls]
            elif self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = self.echo_text(c) + c.text
                if self.want_prompt_logprobs:
                    item["prompt_logprobs"] = self._prompt_logprobs_doc(c)
            if self.want_token_ids:
                item["token_ids"] = list(c.token_ids)
            out.append(item)
        document = {**self._head(False), "choices": out, "usage": usage(choices)}
        if self.chat and self.want_prompt_logprobs:
            document["prompt_logprobs"] = self._prompt_logprobs_doc(choices[0])
        return document

    def echo_chunk(self, choice: Choice) -> dict[str, Any]:
        """The first chunk of an echoing stream: the prompt's text and logprobs."""
        text = self.echo_text(choice)
        item: dict[str, Any] = {"index": choice.index, "text": text, "finish_reason": None,
                                "logprobs": self._logprobs([], [], None, 0, choice)}
        if self.want_prompt_logprobs:
            item["prompt_logprobs"] = self._prompt_logprobs_doc(choice)
        return {**self._head(True), "choices": [item], "usage": None}

    def chunk(self, choice: Choice, delta: Delta, finish_reason: str | None, *,
              role: bool = False) -> dict[str, Any]:
        offset = len(self.echo_text(choice)) + len(choice.sent_text) - len(delta.text)
        item: dict[str, Any] = {"index": choice.index, "finish_reason": finish_reason,
                                "logprobs": self._logprobs(delta.token_ids, delta.logprobs,
                                                           delta.top_logprobs, offset)}
        if self.chat:
            fields: dict[str, Any] = {"role": "assistant"} if role else {}
            text = delta.text
            answer = None if role else self._tool_answer(choice)
            if answer is not None:
                text, calls, item["finish_reason"] = answer.stream(choice.sent_text,
                                                                   finish_reason)
                if calls:
                    fields["tool_calls"] = calls
            if text or role:
                fields["content"] = text
            item["delta"] = fields
        else:
            item["text"] = delta.text
        if self.want_token_ids:
            item["token_ids"] = list(delta.token_ids)
        return {**self._head(True), "choices": [item], "usage": None}

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage(choices)}
