"""The sampler's logits steps: batched transforms of one forward's logits before sampling.

Each step says which requests it applies to (`applies(params)`) and changes the logits of all
those rows at once (`apply`), in the order of `default_steps`: logit bias, min_tokens (EOS and
stop token ids masked), then the penalties (vLLM's order: the additive processors before the
penalties). After the tokens are chosen, `after_sample` lets a step keep state (the penalty
step counts the new tokens). A grammar mask is one more step appended to the list.

The penalties read each request's token history from `TokenHistory`: per request row, on the
device, how often each token was generated and which tokens the prompt holds. It is updated
with every token the sampler picks, and rebuilt from the request when the row changed owner or
its count does not match the tokens generated so far (a retracted request prefilled again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from plugserve.sampling import SamplingParams


@dataclass
class SampleRows:
    """The rows of one forward that sample a token, in logits order."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    reqs: list[Any] = field(default_factory=list)  # the requests (empty: no history known)
    # Per row: the position of the token it samples, i.e. prompt + earlier output tokens.
    positions: list[int] = field(default_factory=list)

    @classmethod
    def plain(cls, params: list[SamplingParams],
              generators: list[torch.Generator | None]) -> SampleRows:
        return cls(params, generators)

    def outputs_before(self, i: int) -> int:
        """Output tokens row i's request had before this sample."""
        return self.positions[i] - len(self.reqs[i].origin_input_ids)


class LogitsStep(Protocol):
    def applies(self, params: SamplingParams) -> bool: ...

    def apply(self, logits: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        """Change `logits[idx]` in place."""

    def after_sample(self, ids: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        """The tokens were chosen (`ids`, every row); `idx`: the rows this step applied to
        that got a token."""


class LogitBias:
    def applies(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        where_rows: list[int] = []
        where_tokens: list[int] = []
        values: list[float] = []
        for i in idx:
            for token, bias in rows.params[i].logit_bias.items():
                where_rows.append(i)
                where_tokens.append(int(token))
                values.append(float(bias))
        dev = logits.device
        logits.index_put_(
            (torch.tensor(where_rows, device=dev), torch.tensor(where_tokens, device=dev)),
            torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)

    def after_sample(self, ids: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        return None


class MinTokens:
    """Until a request generated `min_tokens`, EOS (unless ignored) and its stop token ids
    cannot be sampled."""

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = sorted(eos_token_ids)

    def applies(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0

    def apply(self, logits: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        where_rows: list[int] = []
        where_tokens: list[int] = []
        for i in idx:
            p = rows.params[i]
            done = rows.outputs_before(i) if rows.reqs else 0
            if done >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            where_rows += [i] * len(banned)
            where_tokens += sorted(banned)
        if where_rows:
            dev = logits.device
            logits[torch.tensor(where_rows, device=dev),
                   torch.tensor(where_tokens, device=dev)] = float("-inf")

    def after_sample(self, ids: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        return None


class TokenHistory:
    """Per request row: generated-token counts [rows, vocab] and the prompt's tokens as a
    mask, on the device, allocated when a penalized request first samples."""

    def __init__(self, num_rows: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        # Per row: (request id, output tokens counted) of the request the row's history is of.
        self.owner: list[tuple[int, int] | None] = [None] * num_rows

    def rows_for(self, rows: SampleRows, idx: list[int], vocab: int) -> list[int]:
        """The history rows of the sampled rows `idx`, each made current first."""
        if self.counts is None or self.counts.shape[1] != vocab:
            self.counts = torch.zeros((self.num_rows, vocab), dtype=torch.int32,
                                      device=self.device)
            self.in_prompt = torch.zeros((self.num_rows, vocab), dtype=torch.bool,
                                         device=self.device)
            self.owner = [None] * self.num_rows
        out = []
        for i in idx:
            req = rows.reqs[i]
            row = req.req_pool_idx
            done = rows.outputs_before(i)
            if self.owner[row] != (req.rid, done):
                self._rebuild(row, req, done)
            out.append(row)
        return out

    def _rebuild(self, row: int, req: Any, done: int) -> None:
        assert self.counts is not None and self.in_prompt is not None
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        prompt = torch.tensor(req.origin_input_ids, dtype=torch.int64, device=self.device)
        self.in_prompt[row, prompt] = True
        outputs = req.output_ids[:done]
        if outputs:
            ids = torch.tensor(outputs, dtype=torch.int64, device=self.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.owner[row] = (req.rid, done)

    def add(self, history_rows: list[int], tokens: torch.Tensor) -> None:
        assert self.counts is not None
        where = torch.tensor(history_rows, dtype=torch.int64, device=self.device)
        self.counts.index_put_((where, tokens.to(self.device)),
                               torch.ones(len(history_rows), dtype=torch.int32,
                                          device=self.device), accumulate=True)
        for row in history_rows:
            owner = self.owner[row]
            assert owner is not None
            self.owner[row] = (owner[0], owner[1] + 1)


class Penalties:
    """repetition_penalty (prompt and output tokens), frequency_penalty and presence_penalty
    (output tokens), as vLLM applies them."""

    def __init__(self, history: TokenHistory) -> None:
        self.history = history
        self._rows: list[int] = []

    def applies(self, params: SamplingParams) -> bool:
        return params.penalized

    def apply(self, logits: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        history = self.history
        if not rows.reqs:  # no history known (a one-off batch): a fresh request each
            counts = torch.zeros((len(idx), logits.shape[1]), dtype=torch.int32,
                                 device=logits.device)
            in_prompt = torch.zeros_like(counts, dtype=torch.bool)
        else:
            self._rows = history.rows_for(rows, idx, logits.shape[1])
            assert history.counts is not None and history.in_prompt is not None
            where = torch.tensor(self._rows, device=history.device)
            counts = history.counts[where].to(logits.device)
            in_prompt = history.in_prompt[where].to(logits.device)
        params = [rows.params[i] for i in idx]
        dev, dtype = logits.device, logits.dtype

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)[:, None]

        at = torch.tensor(idx, device=dev)
        sub = logits[at]
        seen_out = counts > 0
        repetition = column([p.repetition_penalty for p in params])
        penalized = (seen_out | in_prompt) & (repetition != 1.0)
        sub = torch.where(penalized, torch.where(sub > 0, sub / repetition, sub * repetition),
                          sub)
        sub = sub - column([p.frequency_penalty for p in params]) * counts.to(dtype)
        sub = sub - column([p.presence_penalty for p in params]) * seen_out.to(dtype)
        logits[at] = sub

    def after_sample(self, ids: torch.Tensor, idx: list[int], rows: SampleRows) -> None:
        if not rows.reqs or not idx:
            return
        history_rows = [rows.reqs[i].req_pool_idx for i in idx]
        self.history.add(history_rows, ids[idx])


def default_steps(history: TokenHistory, eos_token_ids: frozenset[int]
                  ) -> Sequence[LogitsStep]:
    return (LogitBias(), MinTokens(eos_token_ids), Penalties(history))
