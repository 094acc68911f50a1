"""Reference outputs from HF transformers, and seeded workloads, for conformance tests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of token ids in [3, vocab) with lengths in [lo, hi], seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: list[int],
              gguf_file: str | None = None) -> list[list[int]]:
    """Greedy continuations from transformers, one prompt at a time, fp32, no EOS stop.
    With `gguf_file` (a file in `model_dir`) transformers loads that GGUF, dequantized."""
    from transformers import AutoModelForCausalLM

    extra: dict[str, Any] = {} if gguf_file is None else {"gguf_file": gguf_file}
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra)
    model.eval()
    out = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_new, strict=True):
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
            out.append(gen[0, len(ids) :].tolist())
    return out
