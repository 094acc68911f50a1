"""Acceptance: which path of a verified draft tree a request keeps.

Greedy: from the root, follow the child whose token is the target's argmax at the current
node; the target's argmax where no child matches is the bonus token. The output is exactly
what greedy decoding without speculation produces.

Sampling (temperature > 0): the draft proposes fixed tokens (its top-k, not samples), so each
child is accepted with the probability the target gives it under what is left of the target
distribution; a rejected child's token is removed from that distribution (renormalised); when
every child is rejected the bonus token is sampled from the rest. Each emitted token is then
distributed exactly as the target's own sampling would have drawn it.

With a grammar (structured outputs), each node's logits are first masked for the tokens
accepted before it, and the token chosen there is fed to the request's matcher before the
walk goes on (plugserve.grammar.constraint); the walk also ends where the grammar is complete.
Plain decoding masks the same logits the same way, so the output is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugserve.grammar.constraint import TokenConstraint
from plugserve.runner.sampler import sampling_probs
from plugserve.sampling import SamplingParams
from plugserve_spec_eagle.tree import DraftTree


@dataclass
class Accepted:
    path: list[int]  # node indices from the root (0) to the last accepted node
    tokens: list[int]  # emitted: the accepted nodes' tokens, then the bonus token
    logprobs: list[float]  # target log-probability of each emitted token


def accept_all(
    tree: DraftTree,
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    constraints: list[TokenConstraint | None] | None = None,
) -> list[Accepted]:
    """logits: float32 `[batch, num_nodes, vocab]`, the target's at every tree node;
    `constraints`: per request, its grammar (None: free)."""
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    logp = torch.log_softmax(logits, dim=-1)
    tokens = tree.tokens.tolist()
    out: list[Accepted] = []
    for b, p in enumerate(params):
        kids = tree.children(b)
        constraint = constraints[b] if constraints is not None else None
        if constraint is not None:
            path, bonus = _constrained_path(tokens[b], kids, logits[b], p, generators[b],
                                            constraint)
        elif p.greedy:
            path, bonus = _greedy_path(tokens[b], kids, greedy_ids[b])
        else:
            path, bonus = _sampled_path(tokens[b], kids, logits[b], p, generators[b])
        emitted = [tokens[b][i] for i in path[1:]] + [bonus]
        chosen_at = path  # token k was chosen at node path[k]
        lps = [float(logp[b, node, tok]) for node, tok in zip(chosen_at, emitted, strict=True)]
        out.append(Accepted(path, emitted, lps))
    return out


def _greedy_path(tokens: list[int], kids: list[list[int]], argmax: list[int]) -> tuple[list[int], int]:
    path = [0]
    node = 0
    while True:
        want = argmax[node]
        nxt = next((c for c in kids[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def _sampled_path(
    tokens: list[int],
    kids: list[list[int]],
    logits: torch.Tensor,
    p: SamplingParams,
    gen: torch.Generator | None,
) -> tuple[list[int], int]:
    path = [0]
    node = 0
    while True:
        probs = sampling_probs(logits[node], p).cpu()
        accepted = None
        for child in kids[node]:
            tok = tokens[child]
            mass = float(probs[tok])
            u = float(torch.rand((), generator=gen))
            if u < mass:
                accepted = child
                break
            probs[tok] = 0.0
            total = float(probs.sum())
            if total <= 0.0:
                break
            probs /= total
        if accepted is None:
            bonus = int(torch.multinomial(probs, 1, generator=gen).item())
            return path, bonus
        path.append(accepted)
        node = accepted


def _constrained_path(
    tokens: list[int],
    kids: list[list[int]],
    logits: torch.Tensor,
    p: SamplingParams,
    gen: torch.Generator | None,
    constraint: TokenConstraint,
) -> tuple[list[int], int]:
    """The walk under a grammar: at each node the logits masked for the path so far, the
    token chosen from them (greedy: their argmax; sampled: a child accepted with its masked
    probability, as `_sampled_path`), fed to the matcher at once."""
    path = [0]
    node = 0
    while True:
        row = constraint.mask(logits[node])
        if p.greedy:
            want = int(torch.argmax(row))
            nxt = next((c for c in kids[node] if tokens[c] == want), None)
        else:
            nxt, want = _sample_at_node(tokens, kids[node], row, p, gen)
        constraint.accept(want)
        if nxt is None or constraint.terminated:
            return path, want
        path.append(nxt)
        node = nxt


def _sample_at_node(tokens: list[int], kids: list[int], row: torch.Tensor, p: SamplingParams,
                    gen: torch.Generator | None) -> tuple[int | None, int]:
    """(the accepted child or None, the token chosen at this node)."""
    probs = sampling_probs(row, p).cpu()
    for child in kids:
        tok = tokens[child]
        if float(torch.rand((), generator=gen)) < float(probs[tok]):
            return child, tok
        probs[tok] = 0.0
        total = float(probs.sum())
        if total <= 0.0:
            break
        probs /= total
    return None, int(torch.multinomial(probs, 1, generator=gen).item())
