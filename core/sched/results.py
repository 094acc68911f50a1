"""Processing a forward's results: emit tokens, check stops, finish and release requests.

A finished request's KV is released only once no forward that writes it is in flight
(`Req.pending_forwards`): under the overlap loop the next batch may already be running.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from plugserve.sched.stop import check_stop
from plugserve.structs.req import Req

if TYPE_CHECKING:
    from plugserve.sched.scheduler import Scheduler
    from plugserve.structs.step import PreparedStep, StepOutput


def release_when_done(sched: Scheduler, req: Req) -> None:
    """Release a finished request's KV once no forward that writes it is in flight."""
    if req.finish_released or req.pending_forwards > 0:
        return
    if req is sched.chunked_req:
        sched.chunked_req = None
    if req.req_pool_idx is None:
        req.finish_released = True
        return
    sched.kv.release(req)


def _emit(sched: Scheduler, req: Req, token: int, logprob: float | None, now: float) -> bool:
    """Append one output token; True when it finished the request."""
    req.output_ids.append(token)
    if logprob is not None and req.sampling.logprobs:
        req.output_logprobs.append(logprob)
    if req.first_token_s is None:
        req.first_token_s = now
    req.token_times_s.append(now)
    reason = check_stop(req, sched.eos_token_ids, sched.config_context_len, sched.decode_text)
    if reason is None:
        return False
    sched.finish_req(req, reason, now)
    return True


def _fail(sched: Scheduler, req: Req, error: str, now: float) -> None:
    """One request's numbers broke (e.g. a non-finite distribution): it ends with an error,
    the rest of the batch goes on."""
    req.error = error
    sched.finish_req(req, "error", now)


def _process_spec_result(sched: Scheduler, step: PreparedStep, out: StepOutput) -> None:
    """Resolve a speculative round: emit each request's tokens, advance committed."""
    now = time.perf_counter()
    spec_kv = sched.spec_kv
    assert out.spec_tokens is not None and spec_kv is not None
    for i, req in enumerate(step.reqs):
        req.pending_forwards -= 1
        if req.finished() or req.is_retracted:
            spec_kv.forget_round(req)
            if req.finished():
                release_when_done(sched, req)
            continue
        tokens = out.spec_tokens[i]
        logprobs = out.spec_logprobs[i] if out.spec_logprobs is not None else None
        spec_kv.resolve(req, len(tokens))
        req.spec_verify_steps += 1
        req.spec_accepted_tokens += len(tokens) - 1
        req.spec_accept_hist[len(tokens)] = req.spec_accept_hist.get(len(tokens), 0) + 1
        for j, token in enumerate(tokens):
            if _emit(sched, req, token, logprobs[j] if logprobs else None, now):
                break


def process_result(sched: Scheduler, step: PreparedStep, out: StepOutput) -> None:
    if out.spec_tokens is not None:
        _process_spec_result(sched, step, out)
        return
    now = time.perf_counter()
    for i, req in enumerate(step.reqs):
        req.pending_forwards -= 1
        if req.future_ref == out.future_refs[i]:
            req.future_ref = None
        if req.finished():  # finished (or aborted) while this forward was in flight
            release_when_done(sched, req)
            continue
        if req.is_retracted or not step.sample_mask[i]:
            continue
        error = out.errors[i] if out.errors is not None else None
        if error is not None:
            _fail(sched, req, error, now)
            continue
        _emit(sched, req, out.next_token_ids[i],
              out.logprobs[i] if out.logprobs is not None else None, now)
