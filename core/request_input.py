"""Prompt normalisation: a token-id prompt becomes a list of ints, or an error that says what
was wrong, so a malformed prompt is rejected on its own instead of failing its whole call."""

from __future__ import annotations

from collections.abc import Sequence

from plugserve.sampling import describe, is_int


class PromptError(ValueError):
    """The prompt is neither a string nor a sequence of integer token ids."""


def token_ids(prompt: object) -> list[int]:
    """A token-id prompt (a list or tuple of ints, or a 1-D numpy array / torch tensor of
    them) as a list of Python ints. Raises PromptError naming the offending items; bools,
    floats (even 5.0), None, strings and nested lists are not token ids."""
    items = prompt
    if not isinstance(items, (str, bytes, bytearray)) and hasattr(items, "tolist"):
        items = items.tolist()  # numpy array, torch tensor
    if isinstance(items, (str, bytes, bytearray)) or not isinstance(items, Sequence):
        hint = ""
        if is_int(items):
            hint = (
                "; to pass one token-id prompt, put its list inside the list of prompts: "
                "[[5, 6, 7]], not [5, 6, 7]"
            )
        raise PromptError(
            f"prompt must be a string or a list of int token ids, got {describe(prompt)}{hint}"
        )
    bad = [(i, t) for i, t in enumerate(items) if not is_int(t)]
    if bad:
        shown = ", ".join(f"position {i}: {describe(t)}" for i, t in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise PromptError(f"prompt token ids must be ints; got {shown}{more}")
    return [int(t) for t in items]
