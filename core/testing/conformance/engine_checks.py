"""Engine-level checks: whole generations with the backend under test, against transformers.

Every run goes through `plugserve.testing.EngineTest` (the checker at level 1 with physical
page checks), proves the selected backend ran (`probe.BackendProbe`), ends with the memory
whole at idle, and compares tokens:

- float32: greedy output token-identical to HF transformers fp32 (`reference.hf_greedy`);
- bfloat16/float16: the weights themselves are rounded, so identity with fp32 is not a fair
  demand; instead every emitted token must be a near-argmax of HF fp32's logits with the
  engine's own tokens as the context (teacher forcing): `max_logit - logit[token] <=
  HALF_MARGIN[dtype]`. A backend reading the wrong keys misses by whole logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plugserve.sampling import SamplingParams
from plugserve.testing.conformance.probe import BackendProbe
from plugserve.testing.conformance.target import BackendUnderTest
from plugserve.testing.memory import assert_memory_whole
from plugserve.testing.reference import hf_greedy, random_prompts

VOCAB = 256  # byte tokens of the tiny models' tokenizer
# Logits. Rounding the tiny model's weights and activations moves its logits by up to ~0.05
# (bf16) and ~0.005 (fp16); a token chosen under that noise is at most twice that below
# fp32's best. The top two logits are ~0.17 apart (median), whole logits for wrong keys.
HALF_MARGIN = {"bfloat16": 0.15, "float16": 0.02}


@dataclass(frozen=True)
class EngineCase:
    """One engine configuration of a suite test, with what it needs from the backend."""

    id: str
    overrides: dict[str, Any] = field(default_factory=dict)
    requirements: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.id


def paged(page_size: int, **overrides: Any) -> EngineCase:
    """A case at `page_size` (which the backend must declare)."""
    return EngineCase(f"page{page_size}", {"page_size": page_size, **overrides},
                      (f"page_size:{page_size}",))


def workload(kind: str) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts of very different lengths, one sharing a prefix with another, and
    their new-token counts. `long`: the same prompts decoding 40 tokens more (a small KV pool
    then forces retracts); `short`: a few tokens each (for slow backends)."""
    prompts = random_prompts(6, VOCAB, 3, 40, seed=1)
    prompts.append([*prompts[0][:20], 7, 8, 9])
    max_new = {
        "mixed": [12, 5, 20, 9, 16, 1, 14],
        "long": [52, 45, 60, 49, 56, 41, 54],
        "short": [3, 2, 4, 1, 3, 1, 2],
    }.get(kind)
    if max_new is None:
        raise ValueError(f"unknown workload {kind!r}; use 'mixed', 'long' or 'short'")
    return prompts, max_new


def assert_second_round_cached(stats: dict[str, Any], kind: str, page_size: int) -> None:
    """After two rounds of `kind`, the second took every prompt's whole pages from the cache
    (so it computed at most a page per prompt)."""
    prompts, _ = workload(kind)
    most = sum(len(p) for p in prompts) + len(prompts) * page_size
    assert stats["prefill_tokens"] <= most, (
        f"{stats['prefill_tokens']} prefill tokens computed in two rounds; with prefix-cache "
        f"hits in the second it is at most {most}")


@functools.cache
def hf_reference(model_dir: str, kind: str) -> list[list[int]]:
    prompts, max_new = workload(kind)
    return hf_greedy(Path(model_dir), prompts, max_new)


def greedy(max_new: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]


def first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            same = [a == b for a, b in zip(g, w, strict=False)]
            at = same.index(False) if False in same else len(same)
            return (f"request {i} differs first at new token {at}: engine {g[at:at + 4]}, "
                    f"transformers {w[at:at + 4]}")
    return "no difference"


def run_generations(
    engine: Any, target: BackendUnderTest, kind: str, *, rounds: int = 1,
    expected: list[list[int]] | None, probe_layers: bool = True, expect_mixed: bool = False,
) -> list[list[list[int]]]:
    """Generate the workload `rounds` times on `engine` (the second round starts from a warm
    prefix cache); check tokens (when `expected`), memory and the probe (with `expect_mixed`,
    that a mixed chunk ran). Returns the outputs."""
    probe = BackendProbe.attach(engine.backend)
    prompts, max_new = workload(kind)
    outputs = []
    for _ in range(rounds):
        results = engine.generate(prompts, greedy(max_new))
        errors = [r.error for r in results if r.error]
        assert not errors, f"requests failed: {errors}"
        got = [r.token_ids for r in results]
        if expected is not None:
            assert got == expected, (f"{target.name!r}: greedy output differs from "
                                     f"transformers fp32: {first_difference(got, expected)}")
        assert_memory_whole(engine)
        outputs.append(got)
    layers = len(engine.arch.attention_layers()) if probe_layers else None
    probe.assert_ran(target.backend_class, target.name, layers_per_batch=layers)
    if expect_mixed:
        assert probe.mixed_batches > 0, "no mixed chunk ran (prefill beside decodes)"
    checked = engine.stats().get("checker", {}).get("steps_checked", 0)
    assert checked > 0, "the invariant checker did not run (mem_check must be on)"
    return outputs


@functools.cache
def _hf_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def greedy_margins(model_dir: str, prompts: list[list[int]],
                   outputs: list[list[int]]) -> list[list[float]]:
    """Per emitted token: HF fp32's best logit minus the emitted token's logit, with the
    prompt and the engine's earlier tokens as the context (0 = HF's own greedy choice)."""
    model = _hf_model(model_dir)
    margins = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            ids = torch.tensor([[*prompt, *out[:-1]]])
            logits = model(ids).logits[0, len(prompt) - 1 :].double()
            chosen = logits.gather(1, torch.tensor(out)[:, None]).squeeze(1)
            margins.append((logits.max(dim=1).values - chosen).tolist())
    return margins


def assert_near_greedy(model_dir: str, kind: str, outputs: list[list[int]], dtype: str) -> None:
    prompts, _ = workload(kind)
    limit = HALF_MARGIN[dtype]
    for i, margins in enumerate(greedy_margins(model_dir, prompts, outputs)):
        worst = max(margins)
        assert worst <= limit, (
            f"request {i}: new token {margins.index(worst)} is {worst:.3f} logits below "
            f"transformers fp32's best choice (allowed {limit} at {dtype})")
