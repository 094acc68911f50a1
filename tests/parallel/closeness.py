"""Comparing greedy outputs that may split at an fp32 near-tie: vLLM's closeness rule.

Two ranks sum a row-parallel product in a different order than one rank does, so a logit can
move in its last bits and a near-tie can flip. Where two greedy outputs differ, vLLM's tests
accept them when, at the first difference, each side's token is among the other side's top 5.
Here the other side is transformers fp32, teacher-forced on the shared prefix: the engine's
token must be in transformers' top 5 there, and transformers' token must be within a small
logit margin of its best (the engine took another token: they were near tied).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TOP = 5
NEAR_TIE = 0.05  # logits; distinct tokens of these tiny models are ~0.2 apart (median)


@dataclass
class Tally:
    prompts: int = 0
    needed_rule: list[str] = field(default_factory=list)


TALLY = Tally()


@functools.cache
def _hf_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _close(model_dir: Path, prompt: list[int], ours: list[int], ref: list[int]) -> str | None:
    """None when `ours` and `ref` are equal or close by the rule, else why not."""
    if ours == ref:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    if at is None:
        return f"lengths differ: {len(ours)} vs {len(ref)} tokens"
    model = _hf_model(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:at]])).logits[0, -1]
    top = torch.topk(logits, TOP).indices.tolist()
    gap = float(logits.max() - logits[ours[at]])
    if ours[at] in top and gap <= NEAR_TIE:
        return None
    return (f"first difference at new token {at}: engine {ours[at]} (transformers' logit "
            f"{gap:.3f} below its best; its top {TOP}: {top}), transformers {ref[at]}")


def assert_greedy_close(model_dir: Path, prompts: list[list[int]], got: list[list[int]],
                        expected: list[list[int]], what: str) -> None:
    """Token-identical, or close by the rule above (counted in TALLY for the summary)."""
    problems = []
    for i, (prompt, ours, ref) in enumerate(zip(prompts, got, expected, strict=True)):
        TALLY.prompts += 1
        if ours == ref:
            continue
        why = _close(model_dir, prompt, ours, ref)
        if why is None:
            TALLY.needed_rule.append(f"{what} prompt {i}")
        else:
            problems.append(f"prompt {i}: {why}")
    assert not problems, f"{what}: greedy output differs from transformers: " + "; ".join(problems)
