"""PreparedStep and StepOutput: one forward as the runner prepared it, and what it produced.

`ModelRunner.prepare` (scheduler thread) snapshots a schedule batch into a `PreparedStep`;
`ModelRunner.run` (possibly a worker thread) or a speculative algorithm's round turns it into a
`StepOutput` that the scheduler processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugserve.sampling import SamplingParams
from plugserve.structs.forward_batch import ForwardBatch
from plugserve.structs.req import Req


@dataclass
class PreparedStep:
    reqs: list[Req]
    sample_mask: list[bool]
    future_refs: list[int]
    forward_batch: ForwardBatch
    sample_rows: list[int]  # index into reqs of each sampled row
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    want_logprobs: bool
    spec_decode: bool = False  # a speculative round: the spec algorithm runs it
    # Some input id is a future reference (negative: overlap loop), resolved before the forward.
    future_inputs: bool = True


@dataclass
class StepOutput:
    next_token_ids: list[int]  # per request in the batch (-1 where nothing was sampled)
    logprobs: list[float] | None
    future_refs: list[int]
    spec_tokens: list[list[int]] | None = None  # speculative round: tokens per request
    spec_logprobs: list[list[float]] | None = None
    # Per request in the batch: None = fine, else why no token was sampled for it (its logits
    # or probabilities were unusable; next_token_ids holds a placeholder id there). The
    # scheduler finishes such a request with reason "error" and this message. None (the
    # field) = no request of the step failed.
    errors: list[str | None] | None = None
