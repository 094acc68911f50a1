from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from plugserve.testing.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Reference continuation from transformers, one prompt at a time, fp32, no EOS stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    out = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_new, strict=True):
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
            out.append(gen[0, len(ids):].tolist())
    return out
