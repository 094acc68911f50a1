"""Model runner: turns a ScheduleBatch into a ForwardBatch, runs the model, samples.

`prepare` runs on the scheduler thread and snapshots everything the forward needs, so the
scheduler may change its batches while the forward runs (overlap loop). `run` may run on a
worker thread; it resolves *future* input tokens (negative ids -k-1 = entry k of the future
buffer, written by an earlier forward) before the model runs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from plugserve.attention.base import AttentionBackend
from plugserve.pools.kv_pool import KVPool
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.runner import prompt_logprobs
from plugserve.runner.sampler import Sampler, SampleRows
from plugserve.spec.base import SpecAlgorithm
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.structs.schedule_batch import ScheduleBatch
from plugserve.structs.step import PreparedStep, StepOutput


class ModelRunner:
    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        context_len: int,
        device: torch.device,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.context_len = context_len
        self.device = device
        self.future_size = 1 << 16
        self.future_tokens = torch.zeros(self.future_size, dtype=torch.int64, device=device)
        # Whether sampled tokens go into `future_tokens`: only the overlap loop feeds a
        # forward tokens that an earlier one has not handed back yet (the engine sets it).
        self.writes_future_tokens = True
        self._next_ref = 0
        self.time_s: defaultdict[str, float] = defaultdict(float)
        self.spec: SpecAlgorithm | None = None  # set by the engine when speculation is on
        num_rows = req_to_token_pool.num_rows if req_to_token_pool is not None else 0
        self.sampler = Sampler(num_rows, device, eos_token_ids)

    def assign_future_refs(self, batch: ScheduleBatch) -> list[int]:
        refs = [(self._next_ref + i) % self.future_size for i in range(len(batch.reqs))]
        self._next_ref = (self._next_ref + len(batch.reqs)) % self.future_size
        return refs

    def prepare(self, batch: ScheduleBatch, refs: list[int]) -> PreparedStep:
        t0 = time.perf_counter()
        dev = self.device
        last_index = []
        acc = 0
        for e in batch.extend_lens:
            acc += e
            last_index.append(acc - 1)
        sample_rows = [i for i, s in enumerate(batch.sample_mask) if s]
        # A decode batch whose every row samples reads every hidden row: no index tensor.
        every_row = batch.mode is ForwardMode.DECODE and len(sample_rows) == len(batch.reqs)
        fb = ForwardBatch.from_lengths(
            batch.mode,
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.kv_pool,
            device=dev,
            logits_indices=None if every_row else torch.tensor(
                [last_index[i] for i in sample_rows], dtype=torch.int64, device=dev),
        )
        spec_decode = self.spec is not None and batch.mode is ForwardMode.DECODE
        if self.spec is not None and batch.mode is ForwardMode.EXTEND:
            fb.capture_hidden = True
            fb.extra["next_token_ids"] = _shifted_token_ids(batch)
            fb.extra["seq_token_ids"] = [
                list(r.all_ids) if sampled else None
                for r, sampled in zip(batch.reqs, batch.sample_mask, strict=True)
            ]
        reqs = list(batch.reqs)
        if batch.mode is ForwardMode.EXTEND and prompt_logprobs.wanted(reqs, fb):
            fb.capture_hidden = True  # every token's hidden state: prompt logprobs
        params = [reqs[i].sampling for i in sample_rows]
        step = PreparedStep(
            reqs=reqs,
            sample_mask=list(batch.sample_mask),
            future_refs=refs,
            forward_batch=fb,
            sample_rows=sample_rows,
            params=params,
            generators=[reqs[i].generator for i in sample_rows],
            want_logprobs=any(p.logprobs for p in params),
            spec_decode=spec_decode,
            future_inputs=any(token < 0 for token in batch.input_ids),
        )
        self.time_s["prepare"] += time.perf_counter() - t0
        return step

    def run(self, step: PreparedStep) -> StepOutput:
        if step.spec_decode:
            assert self.spec is not None
            with torch.inference_mode():
                spec_out = self.spec.decode(step)
            return StepOutput([-1] * len(step.reqs), None, step.future_refs,
                              spec_out.tokens, spec_out.logprobs)
        fb = step.forward_batch
        t0 = time.perf_counter()
        if step.future_inputs:  # known from the host list: no look at the tensor
            ids = fb.input_ids
            fb.input_ids = torch.where(ids < 0, self.future_tokens[(-ids - 1).clamp(min=0)], ids)
        self.backend.init_forward_metadata(fb)
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(fb, self.backend)
        t2 = time.perf_counter()
        next_ids = [-1] * len(step.reqs)
        logprobs_all: list[float] | None = None
        errors: list[str | None] | None = None
        if step.sample_rows:
            sampled = self._sample(step, out.logits)
            logprobs = sampled.logprobs
            if sampled.any_error:
                errors = [None] * len(step.reqs)
                for row, err in zip(step.sample_rows, sampled.errors, strict=True):
                    errors[row] = err
            for row, token in zip(step.sample_rows, sampled.ids, strict=True):
                next_ids[row] = token
            if self.writes_future_tokens:
                refs = torch.tensor([step.future_refs[r] for r in step.sample_rows],
                                    dtype=torch.int64)
                self.future_tokens[refs.to(self.device)] = torch.tensor(
                    sampled.ids, dtype=torch.int64, device=self.device
                )
            if logprobs is not None:
                logprobs_all = [0.0] * len(step.reqs)
                for row, lp in zip(step.sample_rows, logprobs, strict=True):
                    logprobs_all[row] = lp
        token_hidden = getattr(out, "token_hidden_states", None)
        if token_hidden is not None and prompt_logprobs.wanted(step.reqs, fb):
            prompt_logprobs.compute(self.model, step.reqs, fb, token_hidden)
        t3 = time.perf_counter()
        if self.spec is not None and fb.mode is ForwardMode.EXTEND:
            with torch.inference_mode():
                self.spec.after_extend(step, out, next_ids)
            self.time_s["draft_extend"] += time.perf_counter() - t3
        self.time_s["metadata"] += t1 - t0
        self.time_s["forward"] += t2 - t1
        self.time_s["sample"] += t3 - t2
        return StepOutput(next_ids, logprobs_all, step.future_refs, errors=errors)

    def _sample(self, step: PreparedStep, logits: torch.Tensor) -> Any:
        """Sample every sampled row; each row's top logprobs go into its request by the
        position of the token sampled (what the request's output index is read from)."""
        fb = step.forward_batch
        rows = SampleRows(step.params, step.generators)
        if any(p.top_logprobs or p.decode_time_fields() for p in step.params):
            # The requests' history and positions: the token a row samples goes to position
            # seq_len (its last input is seq_len - 1).
            rows.reqs = [step.reqs[r] for r in step.sample_rows]
            rows.positions = [fb.seq_lens_cpu[r] for r in step.sample_rows]
        sampled = self.sampler.sample(logits, rows, step.want_logprobs)
        reqs, positions = rows.reqs, rows.positions
        if sampled.top_logprobs is not None:
            for req, position, top in zip(reqs, positions, sampled.top_logprobs, strict=True):
                if top is not None:
                    req.top_logprobs_at[position] = top
        return sampled


def _shifted_token_ids(batch: ScheduleBatch) -> list[int]:
    """For each new token of an extend batch, the token that follows it (-1 where that is the
    token this forward samples): what a draft model is fed at the same position."""
    out: list[int] = []
    for req, prefix, ext, sampled in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                         batch.sample_mask, strict=True):
        ids = req.all_ids
        follow = ids[prefix + 1 : prefix + ext + 1]
        if sampled:
            follow = [*follow[: ext - 1], -1]
        out.extend(follow)
    return out
