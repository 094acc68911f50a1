"""Drafter test doubles: one that always proposes the target's own greedy continuation, and
one that proposes random tokens. Both build trees the way the EAGLE drafter does (topk
branches per step, the best `num_draft_tokens` nodes kept) and need no draft KV."""

from __future__ import annotations

import torch

from plugserve.pools.kv_pool import KVPool
from plugserve_spec_eagle.drafter import CatchUp
from plugserve_spec_eagle.state import EagleReqState
from plugserve_spec_eagle.tree import DraftCandidates, DraftTree, chain_tree, select_tree


def _grown_tree(
    roots: torch.Tensor, chains: torch.Tensor, wrong: torch.Tensor, scores: torch.Tensor,
    topk: int, num_nodes: int,
) -> DraftTree:
    """A tree grown like the EAGLE drafter grows one: lane 0 follows `chains` (score 0), every
    other candidate takes tokens from `wrong` with the (negative) `scores` given."""
    batch, steps = chains.shape
    if topk == 1:
        return chain_tree(roots, chains)
    tokens, cand_scores, parents = [], [], []
    # Step 0: topk children of the root.
    first = torch.cat([chains[:, :1], wrong[:, 0, : topk - 1]], dim=1)
    tokens.append(first)
    cand_scores.append(torch.cat([torch.zeros(batch, 1), scores[:, 0, : topk - 1]], dim=1))
    parents.append(torch.full((batch, topk), -1, dtype=torch.int64))
    leaves = torch.arange(topk).expand(batch, -1)  # lane 0's leaf is the true chain
    next_id = topk
    for s in range(1, steps):
        kids = wrong[:, s, : topk * topk].clone().view(batch, topk, topk)
        kid_scores = scores[:, s, : topk * topk].clone().view(batch, topk, topk)
        kids[:, 0, 0] = chains[:, s]
        kid_scores[:, 0, 0] = 0.0
        tokens.append(kids.reshape(batch, -1))
        cand_scores.append(kid_scores.reshape(batch, -1))
        parents.append(leaves[:, :, None].expand(batch, topk, topk).reshape(batch, -1))
        best = torch.topk(kid_scores.reshape(batch, -1), topk, dim=-1, sorted=True)
        leaves = best.indices + next_id
        next_id += topk * topk
    cand = DraftCandidates(torch.cat(tokens, 1), torch.cat(cand_scores, 1), torch.cat(parents, 1))
    return select_tree(roots, cand, num_nodes)


class _DoubleBase:
    def __init__(self, num_steps: int, topk: int, num_draft_tokens: int, vocab: int,
                 seed: int = 0) -> None:
        self.num_steps = num_steps
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def kv_pools(self) -> list[KVPool]:
        return []

    def catch_up(self, batch: CatchUp) -> None:
        return None

    def _wrong(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(self.topk * self.topk, self.topk)
        wrong = torch.randint(0, self.vocab, (batch, self.num_steps, width), generator=self.gen)
        scores = -1.0 - torch.rand(batch, self.num_steps, width, generator=self.gen)
        scores = scores - torch.arange(self.num_steps)[None, :, None] * 2.0
        return wrong, scores


class OracleDrafter(_DoubleBase):
    """Proposes the reference continuation of whichever reference sequence the request is a
    prefix of: with greedy references of the same target, every draft token is accepted."""

    def __init__(self, references: list[list[int]], **kw: int) -> None:
        super().__init__(**kw)
        self.references = references

    def _continuation(self, state: EagleReqState) -> list[int]:
        have = state.token_ids
        for ref in self.references:
            if ref[: len(have)] == have:
                out = ref[len(have) : len(have) + self.num_steps]
                return out + [0] * (self.num_steps - len(out))
        raise AssertionError(f"no reference continues a request of {len(have)} tokens")

    def draft(self, row_ids: torch.Tensor, rows: list[torch.Tensor],
              states: list[EagleReqState]) -> DraftTree:
        roots = torch.tensor([s.last_token for s in states], dtype=torch.int64)
        chains = torch.tensor([self._continuation(s) for s in states], dtype=torch.int64)
        wrong, scores = self._wrong(len(states))
        return _grown_tree(roots, chains, wrong, scores, self.topk, self.num_draft_tokens)


class RandomDrafter(_DoubleBase):
    """Proposes random tokens: nearly every draft token is rejected."""

    def draft(self, row_ids: torch.Tensor, rows: list[torch.Tensor],
              states: list[EagleReqState]) -> DraftTree:
        roots = torch.tensor([s.last_token for s in states], dtype=torch.int64)
        chains = torch.randint(0, self.vocab, (len(states), self.num_steps), generator=self.gen)
        wrong, scores = self._wrong(len(states))
        return _grown_tree(roots, chains, wrong, scores, self.topk, self.num_draft_tokens)
