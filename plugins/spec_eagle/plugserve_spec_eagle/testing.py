"""Test helpers: EAGLE head folders for tiny target models, in seconds."""

from __future__ import annotations

from pathlib import Path

import torch

from plugserve_spec_eagle.head import EagleHead, EagleHeadConfig, save_head

TINY_PROMPTS = 128
TINY_PROMPT_LEN = 6
TINY_NEW_TOKENS = 40
TINY_EPOCHS = 10


def tiny_prompts(seed: int, count: int = TINY_PROMPTS, length: int = TINY_PROMPT_LEN,
                 vocab: int = 256) -> list[list[int]]:
    """Seeded random token-id prompts (byte tokens of the tiny models' tokenizer)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def make_tiny_head_dir(
    target_model_dir: str | Path, out_dir: str | Path, *, trained: bool, seed: int = 0,
    draft_vocab_size: int | None = None,
) -> Path:
    """Write an EAGLE head for the (tiny) target in `target_model_dir` to `out_dir`.

    trained=False: a seeded random head (a random seeded subset of ids as a reduced vocab).
    trained=True: `train_head` on a few seeded random-token prompts and the target's greedy
    continuations (a second or two on a tiny model, run on one CPU thread). Saved in float32.
    """
    if trained:
        from plugserve_spec_eagle.train import train_head

        report = train_head(
            str(target_model_dir), tiny_prompts(seed), out_dir, seed=seed,
            max_new_tokens=TINY_NEW_TOKENS, draft_vocab_size=draft_vocab_size,
            epochs=TINY_EPOCHS, lr=3e-3, batch_size=8, chat=False, dtype_to_save="float32",
            ignore_eos=True, held_out_fraction=0.0, threads=1,
        )
        return report.out_dir
    from plugserve.model import load_model

    target = load_model(target_model_dir, dtype=torch.float32, device="cpu").model
    config = EagleHeadConfig.from_target(target.arch, draft_vocab_size)
    head = EagleHead(config, target, dtype=torch.float32, device="cpu")
    head.init_weights(seed)
    if config.reduced_vocab:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randperm(config.target_vocab_size, generator=gen)[: config.draft_vocab_size]
        head.set_d2t(ids.sort().values)
    return save_head(head, out_dir, dtype="float32")
