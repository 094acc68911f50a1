"""Offline throughput: a fixed random workload, greedy, EOS ignored (nano-vllm's shape).

The workload is `random.seed(0)`; 64 prompts of `randint(16, 256)` random token ids in
0..10000, then 64 output lengths `randint(16, 256)`: 9,536 prompt and 8,224 output tokens.
The engine runs all of it in one `generate` call; `transformers` (optional) runs the same
prompts as left-padded batches, tries a few batch sizes and keeps the best, counting only
each sequence's own output length.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugserve.config import EngineConfig

TOKEN_ID_MAX = 10000
MIN_LEN = 16
# (num_seqs, max_input_len, max_output_len, seed) -> (prompt tokens, output tokens)
CHECKSUMS = {(64, 256, 256, 0): (9536, 8224)}


@dataclass(frozen=True)
class BenchOptions:
    num_seqs: int = 64
    max_input_len: int = 256
    max_output_len: int = 256
    seed: int = 0
    compare_transformers: bool = False
    hf_batch_sizes: Sequence[int] = field(default=(16, 32, 64))

    def __post_init__(self) -> None:
        if self.num_seqs < 1:
            raise ValueError(f"num_seqs must be >= 1, got {self.num_seqs}")
        for name in ("max_input_len", "max_output_len"):
            if getattr(self, name) < MIN_LEN:
                raise ValueError(f"{name} must be >= {MIN_LEN}, got {getattr(self, name)}")
        if self.compare_transformers and not any(b >= 1 for b in self.hf_batch_sizes):
            raise ValueError(f"hf_batch_sizes needs a size >= 1, got {list(self.hf_batch_sizes)}")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_new: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new)

    def within_vocab(self, vocab_size: int) -> Workload:
        """Fold ids into a smaller vocabulary (tiny test models); lengths do not change."""
        if vocab_size > TOKEN_ID_MAX:
            return self
        return Workload([[t % vocab_size for t in p] for p in self.prompts], self.max_new)


def make_workload(options: BenchOptions) -> Workload:
    """The random workload; the default one must match its known token totals."""
    rng = random.Random(options.seed)
    prompts = [
        [rng.randint(0, TOKEN_ID_MAX) for _ in range(rng.randint(MIN_LEN, options.max_input_len))]
        for _ in range(options.num_seqs)
    ]
    max_new = [rng.randint(MIN_LEN, options.max_output_len) for _ in range(options.num_seqs)]
    workload = Workload(prompts, max_new)
    key = (options.num_seqs, options.max_input_len, options.max_output_len, options.seed)
    expected = CHECKSUMS.get(key)
    got = (workload.prompt_tokens, workload.output_tokens)
    if expected is not None and got != expected:
        raise RuntimeError(f"workload checksum mismatch: got {got} tokens, expected {expected}")
    return workload


def run_bench(
    config: EngineConfig, plugins: Sequence[str], options: BenchOptions, console: Any
) -> dict[str, Any]:
    workload = make_workload(options)
    report: dict[str, Any] = {
        "workload": {
            "num_seqs": options.num_seqs,
            "max_input_len": options.max_input_len,
            "max_output_len": options.max_output_len,
            "seed": options.seed,
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
        },
        "config": config.model_dump(mode="json"),
    }
    with console.status(f"plugserve: {options.num_seqs} requests"):
        report["engine"] = run_engine(config, plugins, workload)
    if options.compare_transformers:
        with console.status("transformers: padded batches"):
            report["transformers"] = run_transformers(
                hf_model_dir(config.model),
                workload.within_vocab(report["engine"]["vocab_size"]),
                config.dtype,
                config.device,
                options.hf_batch_sizes,
            )
        hf_rate = report["transformers"]["output_tok_per_s"]
        report["speedup"] = report["engine"]["output_tok_per_s"] / hf_rate if hf_rate else None
    return report


def run_engine(config: EngineConfig, plugins: Sequence[str], workload: Workload) -> dict[str, Any]:
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams

    engine = Engine(config, plugins=tuple(plugins))
    try:
        vocab_size = int(engine.arch.vocab_size)
        work = workload.within_vocab(vocab_size)
        engine.generate([work.prompts[0][:MIN_LEN]], SamplingParams(max_new_tokens=4))  # warm-up
        params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in work.max_new]
        start = time.perf_counter()
        results = engine.generate(work.prompts, params)
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    for result, wanted in zip(results, work.max_new, strict=True):
        if result.error or result.output_tokens != wanted:
            raise RuntimeError(
                f"request {result.index} produced {result.output_tokens} of {wanted} tokens "
                f"(finish reason {result.finish_reason!r}, error {result.error!r}); the "
                "throughput would not be comparable"
            )
    output = sum(r.output_tokens for r in results)
    return {
        "seconds": seconds,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "output_tokens": output,
        "output_tok_per_s": output / seconds,
        "vocab_size": vocab_size,
    }


def hf_model_dir(model: str | None) -> Path:
    """The HF folder transformers reads: the engine's own conversion for GGUF and the default."""
    from plugserve.model.default_model import default_model_path, ensure_converted

    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    return ensure_converted(path) if path.suffix.lower() == ".gguf" else path


def run_transformers(
    model_dir: Path, workload: Workload, dtype: str, device: str, batch_sizes: Sequence[int]
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bench shows its own status line
    sizes = sorted({min(b, len(workload.prompts)) for b in batch_sizes if b >= 1})
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    gen = model.generation_config
    gen.eos_token_id = None  # ignore EOS, like the engine run
    gen.pad_token_id = 0
    gen.do_sample = False
    _padded_generate(model, workload.prompts[:1], 4)  # warm-up
    tries = []
    for size in sizes:
        start = time.perf_counter()
        for first in range(0, len(workload.prompts), size):
            chunk = slice(first, first + size)
            _padded_generate(model, workload.prompts[chunk], max(workload.max_new[chunk]))
        seconds = time.perf_counter() - start
        tries.append(
            {
                "batch_size": size,
                "seconds": seconds,
                "output_tok_per_s": workload.output_tokens / seconds,
            }
        )
    best = max(tries, key=lambda t: t["output_tok_per_s"])
    return {
        "output_tokens": workload.output_tokens,
        "prompt_tokens": workload.prompt_tokens,
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
