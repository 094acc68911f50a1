"""Processing a forward's results: emit tokens and find the requests that finished.

`process_result` changes requests (their output tokens, a failed request's error) and the
KV manager's per-round bookkeeping, and returns the requests that finished with their reason;
the scheduler finishes them in one place (`Scheduler.finish_req`). A request that had
finished while this forward was in flight has its KV released here, now that no forward
writes it (`KVManager.release_if_done`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from plugserve.mem.manager import KVManager
from plugserve.sched.stop import check_stop
from plugserve.structs.req import Req
from plugserve.structs.step import PreparedStep, StepOutput


@dataclass(frozen=True)
class StopRules:
    """What decides that a request is done, besides its own sampling parameters."""

    eos_token_ids: frozenset[int]
    context_len: int
    decode_text: Callable[[list[int]], str]


Finished = list[tuple[Req, str]]  # (request, finish reason)


def _emit(stop: StopRules, req: Req, token: int, logprob: float | None, now: float) -> str | None:
    """Append one output token; the finish reason when it finished the request."""
    req.output_ids.append(token)
    if logprob is not None and req.sampling.logprobs:
        req.output_logprobs.append(logprob)
    if req.first_token_s is None:
        req.first_token_s = now
    req.token_times_s.append(now)
    return check_stop(req, stop.eos_token_ids, stop.context_len, stop.decode_text)


def _process_spec_result(kv: KVManager, stop: StopRules, step: PreparedStep,
                         out: StepOutput) -> Finished:
    """Resolve a speculative round: emit each request's tokens, advance committed."""
    now = time.perf_counter()
    spec = kv.spec
    assert out.spec_tokens is not None and spec is not None
    finished: Finished = []
    for i, req in enumerate(step.reqs):
        req.pending_forwards -= 1
        if req.finished() or req.is_retracted:
            spec.forget_round(req)
            if req.finished():
                kv.release_if_done(req)
            continue
        tokens = out.spec_tokens[i]
        logprobs = out.spec_logprobs[i] if out.spec_logprobs is not None else None
        spec.resolve(req, len(tokens))
        req.spec_verify_steps += 1
        req.spec_accepted_tokens += len(tokens) - 1
        req.spec_accept_hist[len(tokens)] = req.spec_accept_hist.get(len(tokens), 0) + 1
        for j, token in enumerate(tokens):
            reason = _emit(stop, req, token, logprobs[j] if logprobs else None, now)
            if reason is not None:
                finished.append((req, reason))
                break
    return finished


def process_result(kv: KVManager, stop: StopRules, step: PreparedStep,
                   out: StepOutput) -> Finished:
    """Apply one forward's output to its requests; returns those that finished."""
    if out.spec_tokens is not None:
        return _process_spec_result(kv, stop, step, out)
    now = time.perf_counter()
    finished: Finished = []
    for i, req in enumerate(step.reqs):
        req.pending_forwards -= 1
        if req.future_ref == out.future_refs[i]:
            req.future_ref = None
        if req.finished():  # finished (or aborted) while this forward was in flight
            kv.release_if_done(req)
            continue
        if req.is_retracted or not step.sample_mask[i]:
            continue
        error = out.errors[i] if out.errors is not None else None
        if error is not None:
            # One request's numbers broke (e.g. a non-finite distribution): it ends with an
            # error, the rest of the batch goes on.
            req.error = error
            finished.append((req, "error"))
            continue
        reason = _emit(stop, req, out.next_token_ids[i],
                       out.logprobs[i] if out.logprobs is not None else None, now)
        if reason is not None:
            finished.append((req, reason))
    return finished
