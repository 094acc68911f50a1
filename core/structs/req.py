"""Req: one generation request and its KV accounting (DESIGN.md §3)."""

from __future__ import annotations

import time
from typing import Any

import torch

from plugserve.sampling import SamplingParams


class Req:
    def __init__(
        self, rid: int, input_ids: list[int], sampling: SamplingParams,
        session_id: str | None = None,
    ) -> None:
        self.rid = rid
        # A turn of this streaming session: input_ids is the whole conversation so far plus
        # the turn's new tokens, and the session lends its KV (see plugserve.mem.session_kv).
        self.session_id = session_id
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        self.sampling = sampling
        self.generator: torch.Generator | None = None
        if sampling.seed is not None and not sampling.greedy:
            self.generator = torch.Generator().manual_seed(sampling.seed)

        # Memory.
        self.req_pool_idx: int | None = None
        self.last_node: Any = None  # prefix-cache node locked for this request
        self.kv_committed_len = 0  # positions holding valid KV
        self.kv_allocated_len = 0  # slots reserved in the row (>= committed)
        self.cache_protected_len = 0  # page-aligned prefix owned and locked by the cache
        # Hybrid sliding-window models (plugserve.mem.swa_window): SWA KV of positions below
        # this (page-aligned, only grows) was freed; and the first position the most recently
        # prepared forward queries (its window reaches back from there).
        self.swa_evicted_seqlen = 0
        self.swa_read_from = 0
        # Set by the two halves of a release (committed KV, then over-allocation); they must
        # agree whenever a step ends (the checker's seed rule).
        self.kv_committed_freed = False
        self.kv_overallocated_freed = False
        self.cached_tokens = 0  # prompt tokens found in the prefix cache at first admission

        # Scheduling.
        self.extend_input_len = 0  # new tokens in the current extend
        self.is_chunked = 0  # > 0 while a chunked prefill is in progress
        self.is_retracted = False
        self.retract_count = 0
        self.finished_reason: str | None = None
        self.error: str | None = None
        self.finish_released = False  # KV released (finish or abort)
        self.stop_str: str | None = None  # the stop string that ended it (trimmed from text)
        # Forwards launched for this request whose results are not processed yet; its KV is
        # released only when none is left (the overlap loop may still be writing it).
        self.pending_forwards = 0
        # Overlap loop: the future-buffer entry its in-flight forward samples into (its next
        # decode reads the token from there); None once the token is known.
        self.future_ref: int | None = None
        # Overlap loop + speculation: rounds whose bonus slot was pre-claimed (committed += 1)
        # and that have not resolved yet.
        self.spec_preclaims = 0

        # Results and stats.
        self.output_logprobs: list[float] = []
        # Logprobs past the sampled token's, written by the model runner by position (a chunk
        # or decode computed again after a retract writes the same entries again): each prompt
        # position's logprob and top alternatives (sampling.prompt_logprobs; position 0 has
        # none), and the top alternatives of the token sampled at each output position.
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.top_logprobs_at: dict[int, list[tuple[int, float]]] = {}
        self.created_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.token_times_s: list[float] = []
        self.finished_s: float | None = None
        self.spec_verify_steps = 0
        self.spec_accepted_tokens = 0
        self.spec_accept_hist: dict[int, int] = {}  # accept length -> rounds
        # A speculative algorithm's progress for this request, touched only on the forward
        # thread (see plugserve.spec.base).
        self.spec_state: Any = None
        # Structured output: the compile of its grammar (a Future, started at submit), then,
        # once admitted, its matcher state (plugserve.grammar.state.GrammarState).
        self.grammar_future: Any = None
        self.grammar: Any = None

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def reset_for_retract(self) -> None:
        """Back to a waiting request: its KV was released, its tokens are kept."""
        self.req_pool_idx = None
        self.last_node = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.cache_protected_len = 0
        self.swa_evicted_seqlen = 0
        self.swa_read_from = 0
        self.kv_committed_freed = False
        self.kv_overallocated_freed = False
        self.extend_input_len = 0
        self.is_chunked = 0
        self.spec_preclaims = 0

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid}, seq_len={self.seq_len}, committed={self.kv_committed_len}, "
            f"allocated={self.kv_allocated_len}, protected={self.cache_protected_len}, "
            f"row={self.req_pool_idx}, finished={self.finished_reason})"
        )
