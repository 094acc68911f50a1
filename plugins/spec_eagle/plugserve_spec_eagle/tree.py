"""Draft trees: picking the verified nodes from the drafted candidates, and the tree mask.

Nodes of one request's tree are numbered in the order verify sees them: node 0 is the root
(the request's last verified token, whose KV the round writes first), then the selected draft
nodes in the order they were drafted, so a parent always comes before its children. Node i is
verified at position `L + depth[i]` and written at row position `L + i`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftCandidates:
    """Everything drafted in one round, per request: `[batch, num_candidates]`, candidate
    ids in drafting order (depth 1 first). `parents` holds candidate ids (-1 = the root)."""

    tokens: torch.Tensor  # int64 target token ids
    scores: torch.Tensor  # float32 cumulative draft log-probabilities
    parents: torch.Tensor  # int64


@dataclass
class DraftTree:
    """The nodes sent to verify, per request: `[batch, num_nodes]` (node 0 = root)."""

    tokens: torch.Tensor  # int64
    parents: torch.Tensor  # int64, -1 for the root
    depths: torch.Tensor  # int64, 0 for the root

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def ancestor_mask(self) -> torch.Tensor:
        """bool `[batch, n, n]`: entry (i, j) is True when node j is node i or an ancestor."""
        batch, n = self.tokens.shape
        mask = torch.zeros(batch, n, n, dtype=torch.bool)
        rows = torch.arange(batch)
        mask[:, 0, 0] = True
        for i in range(1, n):
            parent = self.parents[:, i].clamp(min=0)
            mask[:, i] = mask[rows, parent]
            mask[:, i, i] = True
        return mask

    def children(self, b: int) -> list[list[int]]:
        """For request b, the child nodes of every node, in node order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, parent in enumerate(self.parents[b].tolist()):
            if parent >= 0:
                kids[parent].append(i)
        return kids


def select_tree(roots: torch.Tensor, cand: DraftCandidates, num_nodes: int) -> DraftTree:
    """Keep the `num_nodes - 1` best candidates by cumulative score (ties: drafted first).

    A child never scores above its parent and ties keep drafting order, so the kept set
    always contains the parents of its members.
    """
    batch, num_cand = cand.tokens.shape
    keep = num_nodes - 1
    if keep > num_cand:
        raise ValueError(f"{num_nodes} tree nodes asked for but only {num_cand} were drafted")
    order = torch.sort(cand.scores, dim=1, descending=True, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=1).values  # drafting order: parents first
    tokens = torch.cat([roots[:, None], cand.tokens.gather(1, chosen)], dim=1)
    # Candidate id -> node index (0 = root, -1 = not kept).
    node_of = torch.full((batch, num_cand + 1), -1, dtype=torch.int64)
    node_of[:, 0] = 0  # candidate parent -1 is shifted to slot 0 = the root
    node_of.scatter_(1, chosen + 1, torch.arange(1, num_nodes).expand(batch, -1).contiguous())
    cand_parent = cand.parents.gather(1, chosen) + 1
    parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.int64),
                         node_of.gather(1, cand_parent)], dim=1)
    if bool((parents[:, 1:] < 0).any()):
        raise AssertionError("a kept draft node's parent was not kept")
    depths = torch.zeros(batch, num_nodes, dtype=torch.int64)
    for i in range(1, num_nodes):
        depths[:, i] = depths.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    return DraftTree(tokens, parents, depths)


def chain_tree(roots: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """A chain: root, then `drafts[:, 0]`, `drafts[:, 1]`, ... each the child of the last."""
    batch, steps = drafts.shape
    n = steps + 1
    tokens = torch.cat([roots[:, None], drafts], dim=1)
    parents = torch.arange(-1, n - 1, dtype=torch.int64).expand(batch, -1).contiguous()
    depths = torch.arange(n, dtype=torch.int64).expand(batch, -1).contiguous()
    return DraftTree(tokens, parents, depths)
