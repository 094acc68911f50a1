"""What the engine-level cache suite generates, and the transformers fp32 greedy output it
must equal (computed once per model folder and workload)."""

from __future__ import annotations

import functools
from pathlib import Path

from plugserve.testing.reference import hf_greedy, random_prompts

VOCAB = 256  # byte tokens of the tiny models' tokenizer
# The hybrid sliding-window tiny model: layer 0 full attention, layers 1-2 windowed (24 tokens).
WINDOWED_ARCH = "qwen2_swa"


def workload(kind: str) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts and their new-token counts.

    `shared`: lengths 3-40, two prompts sharing 20 and 33 tokens with others (prefix reuse
    inside a round, the whole prompts across rounds); `long`: the same decoding ~50 tokens
    (a 128-slot pool then retracts and evicts); `windowed`: prompts of 30-70 tokens and outputs
    crossing the model's 24-token window, one sharing 40 tokens with another.
    """
    if kind in ("shared", "long"):
        prompts = random_prompts(6, VOCAB, 3, 40, seed=11)
        prompts.append([*prompts[0][:20], 7, 8, 9])
        prompts.append([*max(prompts, key=len)[:33], 1, 2])
        new = [12, 5, 20, 9, 16, 1, 14, 8]
        return prompts, new if kind == "shared" else [n + 40 for n in new]
    if kind == "windowed":
        prompts = random_prompts(3, VOCAB, 30, 70, seed=5)
        prompts.append([*prompts[0][:40], 9, 8, 7])
        return prompts, [30, 12, 40, 20]
    raise ValueError(f"unknown workload {kind!r}; use 'shared', 'long' or 'windowed'")


@functools.cache
def hf_reference(model_dir: str, kind: str) -> list[list[int]]:
    prompts, max_new = workload(kind)
    return hf_greedy(Path(model_dir), prompts, max_new)


# A streaming-session script: (the turn's new tokens, new tokens to generate, session_offset).
SESSION_TURNS: dict[str, list[tuple[list[int], int, int | None]]] = {
    "a": [(random_prompts(1, VOCAB, 20, 20, seed=41)[0], 8, None),
          (random_prompts(1, VOCAB, 9, 9, seed=42)[0], 6, None),
          (random_prompts(1, VOCAB, 13, 13, seed=43)[0], 9, None)],
    # The third turn rewinds to 24 tokens (inside the second turn) and continues from there.
    "b": [(random_prompts(1, VOCAB, 17, 17, seed=44)[0], 10, None),
          (random_prompts(1, VOCAB, 5, 5, seed=45)[0], 7, None),
          (random_prompts(1, VOCAB, 11, 11, seed=46)[0], 8, 24)],
}


@functools.cache
def hf_session_reference(model_dir: str, script: str) -> list[list[int]]:
    """Each turn's greedy output when the whole conversation so far is sent as one prompt."""
    conversation: list[int] = []
    outputs = []
    for new_ids, max_new, offset in SESSION_TURNS[script]:
        if offset is not None:
            conversation = conversation[:offset]
        conversation = [*conversation, *new_ids]
        (out,) = hf_greedy(Path(model_dir), [conversation], [max_new])
        outputs.append(out)
        conversation += out
    return outputs
