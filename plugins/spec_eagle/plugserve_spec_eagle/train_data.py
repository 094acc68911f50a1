"""Training data for an EAGLE head: the target's greedy text, its features, the reduced draft
vocabulary, and right-padded teacher-forcing batches.

Draft position i of a sequence t_0..t_{L-1} with features f_0..f_{L-1} reads (t_{i+1}, f_i)
and is trained towards f_{i+1} and t_{i+2}; by default only positions whose t_{i+2} the target
generated count (prompt tokens are not the target's own prediction).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from plugserve.model.llama import CausalLM
from plugserve.model.tokenizer import Tokenizer
from plugserve_spec_eagle.features import target_hidden_states
from plugserve_spec_eagle.head import EagleHead

IGNORE = -100  # draft target of a position that does not count in the token loss


@dataclass
class Example:
    """One training sequence: prompt + the target's greedy continuation, and its features."""

    ids: list[int]
    prompt_len: int
    features: torch.Tensor  # [len(ids), hidden], pre-final-norm

    def target_positions(self, loss_on_prompt: bool) -> list[int]:
        """Draft positions i with a next token t_{i+2} to predict (generated unless
        `loss_on_prompt`)."""
        first = 0 if loss_on_prompt else max(self.prompt_len - 2, 0)
        return list(range(first, len(self.ids) - 2))


def prompt_ids(
    tokenizer: Tokenizer, prompts: Sequence[str | list[int]], chat: bool
) -> list[list[int]]:
    """Token ids of each prompt (token-id prompts pass through; `chat` applies the template)."""
    out: list[list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = (tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                   if chat else tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {len(out)} is empty")
        out.append(ids)
    return out


def generate_continuations(
    target_model: str | None, prompts: Sequence[str | list[int]], *, seed: int,
    max_new_tokens: int, chat: bool, ignore_eos: bool, device: str = "cpu",
) -> tuple[CausalLM, list[list[int]], list[int]]:
    """Greedy float32 continuations by the target: (model, full sequences, prompt lengths)."""
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams

    engine = Engine(model=target_model, dtype="float32", device=device, seed=seed)
    try:
        ids = prompt_ids(engine.tokenizer, prompts, chat)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                ignore_eos=ignore_eos)
        results = engine.generate(ids, params)
    finally:
        engine.close()
    errors = [f"prompt {r.index}: {r.error}" for r in results if r.error]
    if errors:
        raise ValueError("the target could not continue some prompts:\n" + "\n".join(errors))
    sequences = [p + r.token_ids for p, r in zip(ids, results, strict=True)]
    return engine.model, sequences, [len(p) for p in ids]


def prepare_examples(
    target_model: str | Path | None, prompts: Sequence[str | list[int]], *, seed: int,
    max_new_tokens: int, chat: bool, ignore_eos: bool, device: str = "cpu",
    feature_batch_tokens: int = 4096,
) -> tuple[CausalLM, list[Example], dict[str, float]]:
    """The target's greedy continuations and their features: (target, examples, timings)."""
    mark = time.perf_counter()
    model_path = None if target_model is None else str(target_model)
    target, sequences, prompt_lens = generate_continuations(
        model_path, prompts, seed=seed, max_new_tokens=max_new_tokens, chat=chat,
        ignore_eos=ignore_eos, device=device,
    )
    phases = {"generate_s": time.perf_counter() - mark}
    mark = time.perf_counter()
    features = target_hidden_states(target, sequences, batch_tokens=feature_batch_tokens)
    phases["features_s"] = time.perf_counter() - mark
    examples = [Example(s, p, f) for s, p, f in zip(sequences, prompt_lens, features, strict=True)]
    return target, examples, phases


def training_targets(examples: Sequence[Example], loss_on_prompt: bool) -> torch.Tensor:
    """Every token t_{i+2} the head is trained to predict, as one int64 tensor."""
    return torch.tensor(
        [e.ids[i + 2] for e in examples for i in e.target_positions(loss_on_prompt)],
        dtype=torch.int64,
    )


def select_draft_vocab(
    tokens: torch.Tensor, draft_vocab_size: int, vocab_size: int
) -> torch.Tensor:
    """The `draft_vocab_size` most frequent ids of `tokens` (ties: lower id first), sorted."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocab size must be in [1, {vocab_size}], got {draft_vocab_size}")
    counts = torch.bincount(tokens.flatten().to(torch.int64), minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    return order.sort().values


def split_held_out(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, held-out) split of sequence indices; at least one of each when n >= 2."""
    if n < 2 or fraction <= 0:
        return list(range(n)), []
    n_held = min(max(1, round(n * fraction)), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[: n - n_held]), sorted(order[n - n_held:])


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] t_{i+1}
    hidden_in: torch.Tensor  # [B, T, H] f_i
    target_hidden: torch.Tensor  # [B, T, H] f_{i+1}
    target_tokens: torch.Tensor  # [B, T] t_{i+2} (target ids; 0 where absent)
    draft_targets: torch.Tensor  # [B, T] draft index of t_{i+2}, IGNORE where out of vocab/mask
    mask: torch.Tensor  # [B, T] bool: positions that count

    @property
    def positions(self) -> int:
        return int(self.mask.sum())

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def collate(
    examples: Sequence[Example], t2d: torch.Tensor, *, loss_on_prompt: bool, dtype: torch.dtype
) -> Batch:
    """Right-padded teacher-forcing batch: draft position i reads (t_{i+1}, f_i)."""
    hidden_size = examples[0].features.shape[1]
    steps = max(len(e.ids) - 1 for e in examples)
    b = len(examples)
    input_ids = torch.zeros(b, steps, dtype=torch.int64)
    hidden_in = torch.zeros(b, steps, hidden_size, dtype=dtype)
    target_hidden = torch.zeros(b, steps, hidden_size, dtype=dtype)
    target_tokens = torch.zeros(b, steps, dtype=torch.int64)
    mask = torch.zeros(b, steps, dtype=torch.bool)
    for row, e in enumerate(examples):
        n = len(e.ids) - 1
        ids = torch.tensor(e.ids, dtype=torch.int64)
        feats = e.features.to(device="cpu", dtype=dtype)
        input_ids[row, :n] = ids[1:]
        hidden_in[row, :n] = feats[:-1]
        target_hidden[row, :n] = feats[1:]
        target_tokens[row, : n - 1] = ids[2:]
        mask[row, e.target_positions(loss_on_prompt)] = True
    draft_targets = torch.where(mask, t2d[target_tokens], torch.full_like(target_tokens, IGNORE))
    draft_targets = draft_targets.masked_fill(draft_targets < 0, IGNORE)
    return Batch(input_ids, hidden_in, target_hidden, target_tokens, draft_targets, mask)


def batches(
    examples: Sequence[Example], batch_size: int, t2d: torch.Tensor, *, loss_on_prompt: bool,
    dtype: torch.dtype, device: torch.device, order: Sequence[int] | None = None,
) -> list[Batch]:
    idx = list(range(len(examples))) if order is None else list(order)
    chunks = [idx[i: i + batch_size] for i in range(0, len(idx), batch_size)]
    return [collate([examples[i] for i in c], t2d, loss_on_prompt=loss_on_prompt, dtype=dtype)
            .to(device) for c in chunks]


def draft_index_of(head: EagleHead) -> torch.Tensor:
    """target id -> draft index (-1 when the draft vocabulary lacks it), on the CPU."""
    t2d = torch.full((head.config.target_vocab_size,), -1, dtype=torch.int64)
    d2t = head.d2t.cpu()
    t2d[d2t] = torch.arange(d2t.numel())
    return t2d


def read_prompts(path: str | Path) -> list[str]:
    """`.txt`: one prompt per non-empty line; `.jsonl`: one {"prompt": ...} object per line."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: prompts file not found")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if file.suffix == ".txt":
        return lines
    if file.suffix == ".jsonl":
        prompts: list[str] = []
        for n, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{file}:{n}: not JSON: {exc}") from exc
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f'{file}:{n}: expected an object with a string "prompt"')
            prompts.append(record["prompt"])
        return prompts
    raise ValueError(f"{file}: prompts must be a .txt (one per line) or .jsonl file")
