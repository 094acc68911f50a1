"""Speculative options are validated as a whole: a bad combination names what is wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from plugserve.config import EngineConfig


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"draft_model": "head"}, "draft_model set without a speculative algorithm"),
        ({"spec_topk": 4}, "spec_topk set without a speculative algorithm"),
        ({"spec": "eagle", "spec_draft_tokens": 5}, "a chain verifies exactly spec_steps"),
        ({"spec": "eagle", "spec_topk": 2, "spec_steps": 2, "spec_draft_tokens": 8},
         "must be between 2 and 7"),
        ({"spec": "eagle", "enable_mixed_chunk": True}, "enable_mixed_chunk cannot be combined"),
    ],
)
def test_bad_spec_combinations(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_num_draft_tokens() -> None:
    assert EngineConfig(spec="eagle", spec_steps=3).num_draft_tokens == 4
    assert EngineConfig(spec="eagle", spec_steps=3, spec_topk=4).num_draft_tokens == 12
    tree = EngineConfig(spec="eagle", spec_steps=3, spec_topk=4, spec_draft_tokens=8)
    assert tree.num_draft_tokens == 8
