"""Acceptance: which path of a verified draft tree a request keeps.

Greedy: from the root, follow the child whose token is the target's argmax at the current
node; the target's argmax where no child matches is the bonus token. The output is exactly
what greedy decoding without speculation produces.

Sampling (temperature > 0): the draft proposes fixed tokens (its top-k, not samples), so each
child is accepted with the probability the target gives it under what is left of the target
distribution; a rejected child's token is removed from that distribution (renormalised); when
every child is rejected the bonus token is sampled from the rest. Each emitted token is then
distributed exactly as the target's own sampling would have drawn it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
) -> list[Accepted]:
    """logits: float32 `[batch, num_nodes, vocab]`, the target's at every tree node."""
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    logp = torch.log_softmax(logits, dim=-1)
    tokens = tree.tokens.tolist()
    out: list[Accepted] = []
    for b, p in enumerate(params):
        kids = tree.children(b)
        if p.greedy:
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
