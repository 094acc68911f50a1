"""The grammar mask: the sampler's last logits step, for every constrained row at once.

`apply` positions each constrained request's matcher after the output tokens its forward
follows (`GrammarState.sync`), then asks the backend to mask all those rows in one call.
`after_sample` advances each matcher over the token just sampled, on the forward thread, so
the next forward's mask already holds it (see plugserve.grammar.state for the overlap loop).
The time it takes is added to `time_s["grammar_mask"]` (what `plugserve bench` reports).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from plugserve.grammar.service import GrammarService
from plugserve.grammar.state import GrammarState
from plugserve.runner.logits_steps import SampleRows
from plugserve.sampling import SamplingParams


class GrammarMask:
    def __init__(self, service: GrammarService, time_s: defaultdict[str, float]) -> None:
        self.service = service
        self.time_s = time_s

    def applies(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def _state(self, rows: SampleRows, i: int) -> GrammarState:
        state = rows.reqs[i].grammar
        assert isinstance(state, GrammarState), "a constrained request runs without its grammar"
        return state

    def apply(self, logits: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        t0 = time.perf_counter()
        backend = self.service.backend
        can_rollback = self.service.capabilities.rollback
        live: list[int] = []
        matchers = []
        for i in idx:
            req = rows.reqs[i]
            state = self._state(rows, i)
            matcher = state.sync(backend, req.output_ids, rows.outputs_before(i), can_rollback)
            if not matcher.is_terminated():
                live.append(i)
                matchers.append(matcher)
        if live:
            backend.apply_masks(logits, live, matchers)
        self.time_s["grammar_mask"] += time.perf_counter() - t0

    def after_sample(self, ids: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        t0 = time.perf_counter()
        tokens = ids[idx].tolist() if idx else []
        for i, token in zip(idx, tokens, strict=True):
            self._state(rows, i).accept(token)
        self.time_s["grammar_mask"] += time.perf_counter() - t0
