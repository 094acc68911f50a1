"""Structured outputs with EAGLE: drafts are checked against each request's grammar while the
verified tree is walked, so the output is token for token the output without speculation
(greedy), for chain and tree drafting, in the normal and the overlap loops, with the checker at
level 1; free requests beside them are unchanged. An algorithm that does not declare
`grammar` still refuses constrained requests, alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.structured import GrammarSpec
from plugserve.testing import EngineTest
from plugserve.testing.conformance.grammar.languages import SCHEMAS
from plugserve.testing.tiny_models import make_tiny_model_dir

pytest.importorskip("plugserve_spec_eagle")
pytest.importorskip("plugserve_grammar_xgrammar")
pytestmark = pytest.mark.integration  # runs the eagle and xgrammar plugins

SPECS = [GrammarSpec.json_schema(SCHEMAS[1]), GrammarSpec.json_schema(SCHEMAS[2]),
         GrammarSpec.regex(r"[a-z]{2,5}(-[0-9]{1,3}){2}"),
         GrammarSpec.choice(["alpha", "beta", "gamma"]),
         GrammarSpec.ebnf('root ::= ("ab" | "cd")+ "."')]
# Nearly free (any characters, but whole UTF-8 ones, 10 to 20 of them): on the prompts the
# head was trained on, its drafts are often right, so the walk accepts draft tokens under the
# grammar (the random model's bytes are often not UTF-8: the mask still changes its output).
NEARLY_FREE = GrammarSpec.regex(r"(.|\n){10,20}")
TRAINED_ON = 4
TEXT_PROMPTS: list[str | list[int]] = ["one", "two words", "three little words", "free",
                                       "x y z", "free too", "last"]


def prompts() -> list[str | list[int]]:
    """The text prompts, then one the head was trained on (its drafts are often right)."""
    from plugserve_spec_eagle.testing import tiny_prompts

    return [*TEXT_PROMPTS, *tiny_prompts(0)[:TRAINED_ON]]


def sampling() -> list[SamplingParams]:
    constrained = [SamplingParams(max_new_tokens=60, structured_outputs=s) for s in SPECS]
    free = SamplingParams(max_new_tokens=20, ignore_eos=True)
    nearly_free = SamplingParams(max_new_tokens=100, structured_outputs=NEARLY_FREE)
    return [*constrained[:3], free, *constrained[3:], free, *[nearly_free] * TRAINED_ON]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    root = tmp_path_factory.mktemp("grammar_spec")
    target = make_tiny_model_dir(root / "target", seed=3)
    return target, make_tiny_head_dir(target, root / "head", trained=True)


class TestGrammarWithEagle(EngineTest):
    @pytest.fixture
    def expected(self, models: tuple[Path, Path]) -> list[list[int]]:
        from plugserve.engine import Engine

        with Engine(model=str(models[0])) as engine:
            results = engine.generate(prompts(), sampling())
        assert [r.finish_reason for r in results] == ["stop"] * 3 + ["length"] + \
            ["stop"] * 2 + ["length"] + ["stop"] * TRAINED_ON, [(r.finish_reason, r.text)
                                                                for r in results]
        json.loads(results[0].text)
        return [r.token_ids for r in results]

    @pytest.mark.parametrize(("topk", "overlap"), [(1, False), (1, True), (2, False),
                                                   (2, True)],
                             ids=["chain", "chain-overlap", "tree", "tree-overlap"])
    def test_same_tokens_as_without_speculation(
            self, models: tuple[Path, Path], expected: list[list[int]], topk: int,
            overlap: bool) -> None:
        target, head = models
        with self.engine(model=str(target), spec="eagle", draft_model=str(head), spec_steps=3,
                         spec_topk=topk, overlap=overlap) as engine:
            results = engine.generate(prompts(), sampling())
            assert [r.error for r in results] == [None] * len(results)
            assert [r.token_ids for r in results] == expected
            accepted = [r.stats.get("spec_accepted_tokens", 0) for r in results]
            assert sum(accepted[-TRAINED_ON:]) >= 10, f"too few drafts accepted: {accepted}"
            self.assert_idle_memory_whole(engine)


