"""The same prompts through HF transformers `generate`: left-padded batches, greedy, EOS off.

Each batch generates exactly the longest output length of its rows (`min_new_tokens` =
`max_new_tokens`, no EOS id); only each row's own output length is counted. A few batch
sizes are tried and the fastest counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugserve.bench.runner import Runner


@dataclass(frozen=True)
class Comparison:
    """`--compare transformers`: the batch sizes to try."""

    batch_sizes: tuple[int, ...] = (16, 32, 64)

    def __post_init__(self) -> None:
        if not any(b >= 1 for b in self.batch_sizes):
            raise ValueError(f"hf_batch_sizes needs a size >= 1, got {list(self.batch_sizes)}")

    def run(
        self, runner: Runner, prompts: Sequence[list[int]], max_new: Sequence[int]
    ) -> dict[str, Any]:
        """Run transformers on the engine's own prompt ids (same model, dtype and device)."""
        config = runner.config
        with runner.status("transformers: padded batches"):
            return run_transformers(
                hf_model_dir(config.model), prompts, max_new, config.dtype, config.device,
                self.batch_sizes,
            )


def hf_model_dir(model: str | None) -> Path:
    """The HF folder transformers reads: the engine's own conversion for GGUF and the default."""
    from plugserve.model.default_model import default_model_path, ensure_converted

    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    return ensure_converted(path) if path.suffix.lower() == ".gguf" else path


def run_transformers(
    model_dir: Path,
    prompts: Sequence[list[int]],
    max_new: Sequence[int],
    dtype: str,
    device: str,
    batch_sizes: Sequence[int],
) -> dict[str, Any]:
    """Time `generate` over all prompts at each batch size; the best try and all tries."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if len(prompts) != len(max_new):
        raise ValueError(f"got {len(max_new)} output lengths for {len(prompts)} prompts")
    hf_logging.disable_progress_bar()  # the bench shows its own progress
    sizes = sorted({min(b, len(prompts)) for b in batch_sizes if b >= 1})
    if not sizes:
        raise ValueError(f"no batch size >= 1 in {list(batch_sizes)}")
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    gen = model.generation_config
    gen.eos_token_id = None  # ignore EOS, like the engine runs
    gen.pad_token_id = 0
    gen.do_sample = False
    _padded_generate(model, [list(prompts[0])], 4)  # warm-up
    output_tokens = sum(max_new)
    prompt_tokens = sum(len(p) for p in prompts)
    tries = []
    for size in sizes:
        start = time.perf_counter()
        for first in range(0, len(prompts), size):
            chunk = slice(first, first + size)
            _padded_generate(model, [list(p) for p in prompts[chunk]], max(max_new[chunk]))
        seconds = time.perf_counter() - start
        tries.append(
            {
                "batch_size": size,
                "seconds": seconds,
                "output_tok_per_s": output_tokens / seconds,
            }
        )
    best = max(tries, key=lambda t: t["output_tok_per_s"])
    return {
        "requests": len(prompts),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        **best,
        "tries": tries,
    }


def _padded_generate(model: Any, prompts: list[list[int]], max_new: int) -> None:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every row ends at the same column
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
        )
    if out.shape[1] != width + max_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} of {max_new} tokens")


def add_comparison(report: dict[str, Any], hf: dict[str, Any]) -> None:
    """Store the transformers run and each engine run's output tok/s ratio to it."""
    report["transformers"] = hf
    rate = hf["output_tok_per_s"]
    for run in report["runs"]:
        mine = run.get("output_tok_per_s")
        run["vs_transformers"] = mine / rate if mine and rate else None
