"""The text of a growing list of token ids, decoding a few tokens per new event.

Decoding all of a stream's tokens again for every event costs time in the square of its
length: with SmolLM2's tokenizer a 2,000-token stream took 0.75 s of the HTTP process's CPU
that way (0.85 ms per decode at the end), and 64 such streams would take the server's whole
core. The server's streams (`server/output.py`), `Engine.stream`'s event texts and `plugserve
chat`'s printed reply use this instead.

Here (the scheme vLLM and TGI use) each event decodes two short windows that start at the
same token: the tokens read since the last stable point (`context`) and those plus the new
ones (`window`); the text the new tokens add is what `window` has past `context`. Starting
both at the same token keeps a tokenizer's rules for the start of a text (the leading space
SentencePiece drops) out of the difference. While the new text ends in an incomplete UTF-8
sequence (U+FFFD) the window is not moved on, so a character split across tokens comes out
whole once its last byte arrives.
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalText:
    """`text(ids)` for an append-only list of token ids, equal to `render(ids)` for the
    tokenizers whose text of a sequence is its pieces' texts laid end to end (byte-level BPE,
    SentencePiece); the caller decodes the whole list once at the end where it must be exact."""

    def __init__(self, render: Callable[[list[int]], str]) -> None:
        self.render = render
        self._context_start = 0  # ids[_context_start:_read]: decoded again with each window
        self._read = 0  # ids[:_read] are in `_stable`
        self._stable = ""

    def text(self, ids: list[int]) -> str:
        """The text of `ids`, which should only have grown since the last call (ids that
        shrank start the decoding over); its end may be an incomplete character (U+FFFD)
        that later tokens complete."""
        if len(ids) < self._read:  # not append-only after all: start again from the first
            self._context_start = self._read = 0
            self._stable = ""
        if len(ids) == self._read:
            return self._stable
        context = (self.render(ids[self._context_start:self._read])
                   if self._read > self._context_start else "")
        window = self.render(ids[self._context_start:])
        if not window.startswith(context):
            # A tokenizer whose pieces do not lay end to end here: the whole text, decoded
            # once, is the reference; the next windows start from these tokens.
            whole = self.render(ids)
            if not whole.endswith("\ufffd"):
                self._stable = whole
                self._context_start, self._read = self._read, len(ids)
            return whole
        added = window[len(context):]
        if added and not added.endswith("\ufffd"):
            self._stable += added
            self._context_start, self._read = self._read, len(ids)
            return self._stable
        return self._stable + added
