"""The combinations the speculative suite runs: attention backend x page size x topk x
normal/overlap loop, each refused (skipped with the reasons) exactly where the engine's
capability table refuses it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from plugserve.testing.reference import random_prompts

PAGE_SIZES = (1, 16)
TOPKS = (1, 2)
NUM_STEPS = 3
TREE_DRAFT_TOKENS = 4  # verified nodes of a topk>1 tree
VOCAB = 256  # byte tokens of the tiny models' tokenizer


@dataclass(frozen=True)
class SpecCase:
    backend: str
    page_size: int
    topk: int
    overlap: bool

    @property
    def id(self) -> str:
        loop = "overlap" if self.overlap else "normal"
        return f"{self.backend}-page{self.page_size}-topk{self.topk}-{loop}"

    def __str__(self) -> str:
        return self.id

    @property
    def requirements(self) -> tuple[str, ...]:
        """What the algorithm must declare for this case (`SpecRequirements`)."""
        return (("topk_gt1",) if self.topk > 1 else ()) + (("overlap",) if self.overlap else ())

    def overrides(self) -> dict[str, Any]:
        """The engine options of the case (speculation on)."""
        tree = {"spec_draft_tokens": TREE_DRAFT_TOKENS} if self.topk > 1 else {}
        return {"attention": self.backend, "page_size": self.page_size, "spec_topk": self.topk,
                "spec_steps": NUM_STEPS, "overlap": self.overlap, **tree}


def spec_cases(backends: list[str]) -> list[SpecCase]:
    return [SpecCase(b, p, k, o) for b, p, k, o in
            itertools.product(backends, PAGE_SIZES, TOPKS, (False, True))]


def default_device(backend: str) -> str:
    """cpu when the backend declares it, else cuda (as the attention suite chooses)."""
    from plugserve.plugins import get_plugin_host

    devices = get_plugin_host().registries.attention.get(backend).capabilities.devices
    return "cpu" if "cpu" in devices or not devices else "cuda"


def refusal(case: SpecCase, algorithm: str, device: str, needs_draft: bool) -> str | None:
    """Why the engine would refuse the case here (None: it runs): the capability table of the
    registered plugins (`validate_config`) and this machine's devices."""
    import pydantic

    from plugserve.config import EngineConfig
    from plugserve.device import device_problems
    from plugserve.plugins import get_plugin_host
    from plugserve.validation import validate_config

    try:
        config = EngineConfig(spec=algorithm, device=device, dtype="float32", mem_check=0,
                              draft_model="draft" if needs_draft else None, **case.overrides())
    except pydantic.ValidationError as exc:
        return f"configuration refused: {exc}"
    reasons = validate_config(config, get_plugin_host().registries) + device_problems(device)
    return "; ".join(reasons) if reasons else None


def workload() -> tuple[list[list[int]], list[int]]:
    """Seeded prompts of 3-40 tokens (crossing pages of 16), one sharing 20 tokens with
    another, and enough new tokens for several rounds each."""
    prompts = random_prompts(5, VOCAB, 3, 40, seed=17)
    prompts.append([*prompts[0][:20], 5, 6, 7])
    return prompts, [16, 9, 21, 12, 18, 14]
