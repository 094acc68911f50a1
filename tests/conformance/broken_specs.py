"""Deliberately broken speculative algorithms: test doubles proving that the speculative suite
can fail. Each is the shipped EAGLE algorithm with one promise of the contract broken;
registered as a plugin ("broken_specs") by the `spec_plugins` fixture, with EAGLE's
capabilities (and its test draft, `build_test_draft`)."""

from __future__ import annotations

from typing import Any

from plugserve.config import EngineConfig
from plugserve.hookspecs import hookimpl
from plugserve.spec.base import SpecDecodeOutput
from plugserve.structs.spec_footprint import SpecFootprint
from plugserve.structs.step import PreparedStep
from plugserve_spec_eagle.algorithm import EagleAlgorithm
from plugserve_spec_eagle.plugin import CAPABILITIES


class ShortFootprint(EagleAlgorithm):
    """Declares a round one slot smaller than it is (the usual two-round reserve of that):
    with a chain, whose footprint is tight, a round writes one position past what it
    declared. The reserve still covers it under the normal loop, so the law holds and the
    output is right; only the footprint probe sees it (under the overlap loop the reserve
    falls short too)."""

    name = "eagle_short_footprint"

    @classmethod
    def plan_footprint(cls, config: EngineConfig) -> SpecFootprint:
        real = super().plan_footprint(config)
        return SpecFootprint.for_round(real.alloc_len_per_decode - 1, config.page_size)


class WrongToken(EagleAlgorithm):
    """Emits a wrong bonus token in every third round of a request."""

    name = "eagle_wrong_token"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: dict[int, int] = {}

    def decode(self, step: PreparedStep) -> SpecDecodeOutput:
        out = super().decode(step)
        for req, tokens in zip(step.reqs, out.tokens, strict=True):
            self.rounds[req.rid] = self.rounds.get(req.rid, 0) + 1
            if self.rounds[req.rid] % 3 == 0:
                tokens[-1] = (tokens[-1] + 1) % self.ctx.arch.vocab_size
        return out


BROKEN: dict[str, type[EagleAlgorithm]] = {
    cls.name: cls for cls in (ShortFootprint, WrongToken)
}


@hookimpl
def plugserve_register_spec_algorithms(register: Any) -> None:
    for name, cls in BROKEN.items():
        register(name, lambda cls=cls: cls, CAPABILITIES, description=cls.__doc__ or "")
