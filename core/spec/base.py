"""The speculative algorithm protocol (docs/spec_algorithms.md).

A spec plugin registers a `SpecAlgorithm` subclass; the engine builds it once with a
`SpecContext`. The algorithm states its KV *footprint* (`SpecFootprint`: how many slots one
round may touch, how many the scheduler keeps reserved, how much wider the request rows must
be); the core keeps all KV *accounting* from it (when slots are claimed and released, see
`plugserve.mem.spec_accounting`); the algorithm never allocates or frees a slot, and writes
KV only at row positions `[L, L + alloc_len_per_decode)` of its requests' rows (L = the
request's verified length), all of which the core allocated before the round. It does the
model work on the forward thread:

- `after_extend`: after every target prefill chunk, so the draft catches up on the new
  tokens (and, for a request's last chunk, seeds its first draft from the sampled token);
- `decode`: one speculative round for every request of a decode batch: draft, verify with a
  tree mask, accept, move the accepted KV into place and advance the draft. It returns the
  tokens each request emits (accepted draft tokens, then the bonus token).

Under the overlap loop `decode` for round N+1 runs before the scheduler has seen round N's
result, so an algorithm keeps its per-request progress (verified length, last token, draft
seed) itself, on `req.spec_state`, touched only from the forward thread. The slots a round
writes are read from `req_to_token` at positions the scheduler allocated in advance. The
core's side of that: the round's first slot (the last verified token's KV, written by every
round) is pre-claimed when the round is prepared, and resolving the round adds the rest of
what it emitted.

`plugserve conformance --spec NAME` proves an algorithm keeps this contract (lossless greedy
output, the conservation law, a probe of every round's writes against its footprint).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plugserve.config import EngineConfig
from plugserve.structs.spec_footprint import SpecFootprint

if TYPE_CHECKING:
    from plugserve.attention.base import AttentionBackend
    from plugserve.model.arch import ModelArchConfig
    from plugserve.pools.kv_pool import KVPool
    from plugserve.pools.req_to_token import ReqToTokenPool
    from plugserve.structs.step import PreparedStep


@dataclass
class SpecContext:
    """What the engine hands a speculative algorithm at start-up."""

    config: EngineConfig
    target: Any  # plugserve.model.llama.CausalLM
    arch: ModelArchConfig
    backend: AttentionBackend
    target_kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    num_pages: int  # of the target pool; a draft pool uses the same slots
    dtype: torch.dtype
    device: torch.device
    time_s: dict[str, float] = field(default_factory=dict)  # the runner's timing breakdown
    # The engine's grammar service (structured outputs), or None: an algorithm declaring
    # `SpecCapabilities.grammar` walks each constrained request's drafts through it
    # (plugserve.grammar.constraint).
    grammar: Any = None


@dataclass
class SpecDecodeOutput:
    """One round's result, per request of the batch (request order)."""

    tokens: list[list[int]]  # emitted tokens: accepted draft tokens, then the bonus token
    logprobs: list[list[float]] | None = None  # target log-probability of each emitted token


class SpecAlgorithm(ABC):
    def __init__(self, ctx: SpecContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.footprint = self.plan_footprint(ctx.config)

    @classmethod
    @abstractmethod
    def plan_footprint(cls, config: EngineConfig) -> SpecFootprint:
        """The footprint for `config` (page size, topk, steps, overlap loop, ...). A
        classmethod because the engine sizes the request rows from it before the algorithm
        (which reads those rows) is built; the instance keeps the same answer as
        `self.footprint`, which the scheduler reads. What each field promises:
        `plugserve.structs.spec_footprint.SpecFootprint`."""

    @classmethod
    def build_test_draft(cls, target_dir: Path, out_dir: Path) -> Path | None:
        """A draft model for the tiny target model in `target_dir` (a folder written by
        `plugserve.testing.tiny_models`: 2 layers, 64 hidden, a 261-token byte vocabulary),
        written into `out_dir`; the conformance suite passes it as `draft_model`. Called in a
        child process, once per target per test session; a few seconds is fine (train a small
        head on the target's own greedy output, say), and a draft that accepts some tokens
        makes the suite's lossless check meaningful. None (the default): the algorithm needs
        no draft model. An algorithm registered with `needs_draft_model=True` must override
        it."""
        return None

    @property
    def kv_pools(self) -> list[KVPool]:
        """Extra KV pools (e.g. the draft's) indexed by the same slots as the target's."""
        return []

    @abstractmethod
    def after_extend(self, step: PreparedStep, output: Any, next_token_ids: list[int]) -> None:
        """A target extend ran (`output` is its `CausalLMOutput` with every token's hidden
        state); `next_token_ids[i]` is the token sampled for request i, or -1."""

    @abstractmethod
    def decode(self, step: PreparedStep) -> SpecDecodeOutput:
        """Run one speculative round for every request of `step`."""
