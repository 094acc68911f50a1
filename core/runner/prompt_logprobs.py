"""Prompt logprobs: each prompt token's logprob given the tokens before it, computed from an
extend forward's per-token hidden states a chunk of rows at a time.

The logits of every prompt position would be a [tokens, vocab] tensor (2,048 x 49,152 floats
is 400 MB): the rows are turned into logits `ROW_BYTES_BUDGET` bytes at a time, reduced to the
next token's logprob and the top N, and dropped. Results go into the request by position
(`Req.prompt_logprobs[j]`: token j given tokens 0..j-1), so a chunked prefill fills them chunk
by chunk and a prefill computed again after a retract writes the same entries again. A request
that asks for them does not read the prefix cache (`KVManager.admit`), so every position is
computed; what the cache held is recomputed, its accounting unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from plugserve.structs.forward_batch import ForwardBatch
from plugserve.structs.req import Req

LOGITS_BYTES_BUDGET = 32 << 20  # float32 logits computed at once per chunk of rows


def wanted(reqs: list[Req], fb: ForwardBatch) -> bool:
    """Whether any request of this extend forward computes prompt positions whose logprobs it
    asked for (then the model must return every token's hidden state)."""
    return any(
        r.sampling.prompt_logprobs is not None and prefix < len(r.origin_input_ids) - 1
        for r, prefix in zip(reqs, fb.extend_prefix_lens_cpu, strict=True)
    )


def compute(model: Any, reqs: list[Req], fb: ForwardBatch, token_hidden: torch.Tensor) -> None:
    """Fill the prompt logprobs of the positions this forward computed.

    `token_hidden`: the last layer's output before the final norm, one row per token of the
    batch, in batch order."""
    vocab = int(model.lm_head_weight.shape[0])
    rows_at_once = max(1, LOGITS_BYTES_BUDGET // (4 * vocab))
    start = 0
    for req, prefix, extend in zip(reqs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu,
                                   strict=True):
        top_n = req.sampling.prompt_logprobs
        prompt = req.origin_input_ids
        # Row j (position j) predicts token j + 1; the last prompt position predicts the first
        # output token (the sampler's business).
        end = min(prefix + extend, len(prompt) - 1)
        if top_n is not None and prefix < end:
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * len(prompt)
                req.prompt_top_logprobs = [None] * len(prompt)
            for first in range(prefix, end, rows_at_once):
                last = min(first + rows_at_once, end)
                hidden = token_hidden[start + first - prefix : start + last - prefix]
                _fill(model, req, hidden, first, last, top_n)
        start += extend


def _fill(model: Any, req: Req, hidden: torch.Tensor, first: int, last: int, top_n: int
          ) -> None:
    assert req.prompt_logprobs is not None and req.prompt_top_logprobs is not None
    logp = torch.log_softmax(model.compute_logits(model.final_norm(hidden)).float(), dim=-1)
    targets = torch.tensor(req.origin_input_ids[first + 1 : last + 1], dtype=torch.int64,
                           device=logp.device)
    values = logp.gather(1, targets[:, None]).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in values]
    if top_n > 0:
        top_values, top_ids = logp.topk(top_n, dim=-1)
        tops = [list(zip(ids, vals, strict=True))
                for ids, vals in zip(top_ids.tolist(), top_values.tolist(), strict=True)]
    for k, value in enumerate(values):
        req.prompt_logprobs[first + 1 + k] = value
        req.prompt_top_logprobs[first + 1 + k] = tops[k]
