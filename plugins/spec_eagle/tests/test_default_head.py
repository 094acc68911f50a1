"""The head shipped for the built-in default model (SmolLM2-135M-Instruct): it loads with no
path given, speculative greedy output equals plain greedy output, and it gets accepted. The
prompts are not among its training prompts."""

from __future__ import annotations

import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve_spec_eagle.weights import default_head_dir

PROMPTS = [
    "What is the boiling point of water at sea level?",
    "Write a shell command that counts the lines in every .txt file of a folder.",
    "Give three tips for a job interview.",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Engine() as engine:
        return [r.token_ids for r in engine.generate(PROMPTS, sp, chat=True)]


def test_shipped_head_is_packaged() -> None:
    folder = default_head_dir()
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (folder / "model.safetensors").stat().st_size <= 25 * 1024 * 1024


class TestDefaultHead(EngineTest):
    # Mean acceptance lengths measured on these prompts: chain 1.51, tree 1.75. The head is
    # weak (see TRAINING.md), so the chain's floor is lower than the tree's.
    @pytest.mark.parametrize(("topk", "page", "floor"), [(1, 1, 1.3), (4, 16, 1.5)],
                             ids=["chain", "tree-page16"])
    def test_lossless_with_real_acceptance(
        self, topk: int, page: int, floor: float, plain_outputs: list[list[int]]
    ) -> None:
        sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        extra = {"spec_draft_tokens": 8} if topk > 1 else {}
        with self.engine(spec="eagle", spec_steps=3, spec_topk=topk, page_size=page,
                         **extra) as engine:
            out = engine.generate(PROMPTS, sp, chat=True)
            self.assert_idle_memory_whole(engine)
        assert [r.token_ids for r in out] == plain_outputs
        rounds = sum(r.stats["spec_verify_steps"] for r in out)
        accepted = sum(r.stats["spec_accepted_tokens"] for r in out)
        accept_len = (accepted + rounds) / rounds
        assert accept_len > floor, f"mean acceptance length {accept_len:.2f}"
