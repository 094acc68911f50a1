"""Shared fixtures: a tiny target, draft heads for it (random and trained), prompts, and the
target's plain greedy output to compare speculative output against."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))

# Prompt lengths cross page boundaries of 4 and 16; outputs cross several more.
PROMPTS = [
    [5, 17, 3],
    [40, 41, 42, 43, 44, 45, 46, 47, 48],
    [(11 * i + 7) % 200 + 3 for i in range(17)],
    [(5 * i + 1) % 150 + 30 for i in range(30)],
]
MAX_NEW = 24
NUM_STEPS = 3


def greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)



@pytest.fixture(scope="session")
def target_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session")
def random_head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    return make_tiny_head_dir(target_dir, tmp_path_factory.mktemp("head_random"), trained=False)


@pytest.fixture(scope="session")
def trained_head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    return make_tiny_head_dir(target_dir, tmp_path_factory.mktemp("head_trained"), trained=True)


@pytest.fixture(scope="session")
def reference(target_dir: Path) -> list[list[int]]:
    """Plain greedy output (no speculation) for PROMPTS."""
    with Engine(model=str(target_dir), dtype="float32") as engine:
        return [r.token_ids for r in engine.generate(PROMPTS, greedy())]


@pytest.fixture(scope="session")
def long_reference(target_dir: Path) -> list[list[int]]:
    """Prompt + a plain greedy continuation long enough for an oracle draft's last round."""
    with Engine(model=str(target_dir), dtype="float32") as engine:
        out = engine.generate(PROMPTS, greedy(MAX_NEW + NUM_STEPS + 2))
    return [p + r.token_ids for p, r in zip(PROMPTS, out, strict=True)]
