"""Unit tests of the draft-tree helpers: `select_tree`, `DraftTree.ancestor_mask`,
`DraftTree.children` and `chain_tree` (no engine, no model)."""

from __future__ import annotations

import itertools

import pytest
import torch

from plugserve_spec_eagle.tree import DraftCandidates, DraftTree, chain_tree, select_tree


def _cands(tokens: list[list[int]], scores: list[list[float]],
           parents: list[list[int]]) -> DraftCandidates:
    return DraftCandidates(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(scores, dtype=torch.float32),
        torch.tensor(parents, dtype=torch.int64),
    )


def _tree(tokens: list[list[int]], parents: list[list[int]]) -> DraftTree:
    """A hand-built tree; depths follow from the parents."""
    par = torch.tensor(parents, dtype=torch.int64)
    depths = torch.zeros_like(par)
    for i in range(1, par.shape[1]):
        depths[:, i] = depths.gather(1, par[:, i : i + 1].clamp(min=0)).squeeze(1) + 1
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), par, depths)


# A hand-built round, drafted the way EagleDrafter drafts it (topk 2, 3 steps): candidate ids
# in drafting order, parents by candidate id (-1 = root), cumulative log-probabilities.
#
#   id  token  parent  score
#   0   10     -1      -0.2
#   1   11     -1      -1.0
#   2   20      0      -0.5   (children of lane 0 = cand 0)
#   3   21      0      -2.0
#   4   22      1      -1.3   (children of lane 1 = cand 1)
#   5   23      1      -3.0
#   6   30      2      -0.9   (children of the best two of step 1: cand 2 and cand 4)
#   7   31      2      -2.5
#   8   32      4      -1.4
#   9   33      4      -4.0
HAND_TOKENS = [10, 11, 20, 21, 22, 23, 30, 31, 32, 33]
HAND_PARENTS = [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
HAND_SCORES = [-0.2, -1.0, -0.5, -2.0, -1.3, -3.0, -0.9, -2.5, -1.4, -4.0]


def _hand() -> DraftCandidates:
    return _cands([HAND_TOKENS], [HAND_SCORES], [HAND_PARENTS])


def _expected_nodes(keep: int, scores: list[float]) -> list[int]:
    """Candidate ids kept, in drafting order: the best `keep` by score, ties drafted first."""
    ranked = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
    return sorted(ranked[:keep])


class TestSelectTree:
    def test_keeps_the_best_by_cumulative_score(self) -> None:
        # Best 5 by score: 0 (-0.2), 2 (-0.5), 6 (-0.9), 1 (-1.0), 4 (-1.3).
        tree = select_tree(torch.tensor([7]), _hand(), num_nodes=6)
        assert tree.tokens.tolist() == [[7, 10, 11, 20, 22, 30]]
        # Node indices: root 0, cand 0 -> 1, cand 1 -> 2, cand 2 -> 3, cand 4 -> 4, cand 6 -> 5.
        assert tree.parents.tolist() == [[-1, 0, 0, 1, 2, 3]]
        assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 3]]
        assert tree.num_nodes == 6

    @pytest.mark.parametrize("num_nodes", range(1, len(HAND_TOKENS) + 2))
    def test_every_size(self, num_nodes: int) -> None:
        tree = select_tree(torch.tensor([7]), _hand(), num_nodes=num_nodes)
        kept = _expected_nodes(num_nodes - 1, HAND_SCORES)
        assert tree.tokens[0, 1:].tolist() == [HAND_TOKENS[c] for c in kept]
        node_of = {c: i + 1 for i, c in enumerate(kept)}
        want_parents = [-1] + [0 if HAND_PARENTS[c] < 0 else node_of[HAND_PARENTS[c]]
                               for c in kept]
        assert tree.parents[0].tolist() == want_parents
        _check_shape(tree)

    def test_root_tokens_first(self) -> None:
        roots = torch.tensor([3, 4])
        cand = _cands([HAND_TOKENS, HAND_TOKENS], [HAND_SCORES, HAND_SCORES],
                      [HAND_PARENTS, HAND_PARENTS])
        tree = select_tree(roots, cand, num_nodes=4)
        assert tree.tokens[:, 0].tolist() == [3, 4]
        assert tree.parents[:, 0].tolist() == [-1, -1]
        assert tree.depths[:, 0].tolist() == [0, 0]

    def test_rows_select_independently(self) -> None:
        # Row 1 prefers lane 1's subtree (its scores are shifted); row 0 is the hand case.
        other = [-1.0, -0.1, -2.0, -2.1, -0.3, -0.6, -2.5, -2.6, -0.4, -0.7]
        cand = _cands([HAND_TOKENS, HAND_TOKENS], [HAND_SCORES, other],
                      [HAND_PARENTS, HAND_PARENTS])
        tree = select_tree(torch.tensor([7, 8]), cand, num_nodes=5)
        for b, scores in enumerate([HAND_SCORES, other]):
            kept = _expected_nodes(4, scores)
            assert tree.tokens[b, 1:].tolist() == [HAND_TOKENS[c] for c in kept]
        # Row 1 keeps cands 1 (-0.1), 4 (-0.3), 8 (-0.4), 5 (-0.6): a chain 11 -> 22 -> 32
        # plus 23 next to 22.
        assert tree.tokens[1].tolist() == [8, 11, 22, 23, 32]
        assert tree.parents[1].tolist() == [-1, 0, 1, 1, 2]
        assert tree.depths[1].tolist() == [0, 1, 2, 2, 3]
        _check_shape(tree)

    def test_ties_keep_drafting_order(self) -> None:
        # Every candidate scores the same: the first drafted ones are kept.
        scores = [-1.0] * len(HAND_TOKENS)
        cand = _cands([HAND_TOKENS], [scores], [HAND_PARENTS])
        tree = select_tree(torch.tensor([7]), cand, num_nodes=4)
        assert tree.tokens.tolist() == [[7, 10, 11, 20]]
        assert tree.parents.tolist() == [[-1, 0, 0, 1]]

    def test_tie_at_the_cut_prefers_the_earlier_candidate(self) -> None:
        # Cands 1 and 6 tie for the last place (-1.0); cand 1 was drafted first.
        scores = list(HAND_SCORES)
        scores[6] = -1.0
        cand = _cands([HAND_TOKENS], [scores], [HAND_PARENTS])
        tree = select_tree(torch.tensor([7]), cand, num_nodes=4)
        assert tree.tokens.tolist() == [[7, 10, 11, 20]]
        tree = select_tree(torch.tensor([7]), cand, num_nodes=5)
        assert tree.tokens.tolist() == [[7, 10, 11, 20, 30]]

    def test_certain_child_ties_with_its_parent(self) -> None:
        # A draft step with probability 1 gives a child its parent's score: the stable sort
        # still keeps the parent, and the parent comes first.
        tokens = [[5, 6, 7, 8]]
        parents = [[-1, -1, 0, 2]]
        scores = [[-0.5, -0.7, -0.5, -0.5]]
        tree = select_tree(torch.tensor([1]), _cands(tokens, scores, parents), num_nodes=3)
        assert tree.tokens.tolist() == [[1, 5, 7]]
        assert tree.parents.tolist() == [[-1, 0, 1]]
        tree = select_tree(torch.tensor([1]), _cands(tokens, scores, parents), num_nodes=4)
        assert tree.tokens.tolist() == [[1, 5, 7, 8]]
        assert tree.depths.tolist() == [[0, 1, 2, 3]]

    def test_more_nodes_than_drafted_is_an_error(self) -> None:
        with pytest.raises(ValueError, match=r"12 tree nodes asked for but only 10 were drafted"):
            select_tree(torch.tensor([7]), _hand(), num_nodes=12)
        # Exactly every candidate plus the root is fine.
        tree = select_tree(torch.tensor([7]), _hand(), num_nodes=11)
        assert sorted(tree.tokens[0, 1:].tolist()) == sorted(HAND_TOKENS)

    def test_a_child_above_its_parent_is_refused(self) -> None:
        # Not something a drafter produces (log-probabilities only add negative terms), but
        # a tree missing a parent must never reach verify.
        scores = [[-3.0, -0.1, -0.2]]
        cand = _cands([[1, 2, 3]], scores, [[-1, -1, 0]])
        with pytest.raises(AssertionError, match="parent was not kept"):
            select_tree(torch.tensor([0]), cand, num_nodes=3)

    @pytest.mark.parametrize(("topk", "steps", "seed"),
                             [(2, 3, 0), (3, 3, 1), (4, 2, 2), (4, 4, 3), (2, 5, 4)])
    def test_grown_like_the_drafter(self, topk: int, steps: int, seed: int) -> None:
        """Random rounds grown as EagleDrafter grows them; every size is checked against a
        brute-force pick, with coarse scores so ties are common."""
        batch = 3
        cand = _grow(batch, topk, steps, torch.Generator().manual_seed(seed))
        roots = torch.arange(batch) + 900
        num_cand = cand.tokens.shape[1]
        for num_nodes in range(1, num_cand + 2):
            tree = select_tree(roots, cand, num_nodes)
            _check_shape(tree)
            for b in range(batch):
                scores = cand.scores[b].tolist()
                kept = _expected_nodes(num_nodes - 1, scores)
                assert tree.tokens[b, 1:].tolist() == [int(cand.tokens[b, c]) for c in kept]
                node_of = {c: i + 1 for i, c in enumerate(kept)}
                for i, c in enumerate(kept, start=1):
                    parent = int(cand.parents[b, c])
                    assert int(tree.parents[b, i]) == (0 if parent < 0 else node_of[parent])
                    # The depth is the candidate's drafting step.
                    assert int(tree.depths[b, i]) == _cand_depth(cand, b, c)


def _grow(batch: int, topk: int, steps: int, gen: torch.Generator) -> DraftCandidates:
    """Candidates as EagleDrafter drafts them: topk children of the root, then topk children
    of each of the topk best leaves per step; scores are cumulative, coarse (ties happen)."""
    def logp(*shape: int) -> torch.Tensor:
        # Multiples of 0.25 in [-1.5, 0]: sorted descending like a top-k, with zeros (a
        # certain step) and ties.
        values = -torch.randint(0, 7, shape, generator=gen).float() * 0.25
        return values.sort(dim=-1, descending=True).values

    tokens = [torch.randint(0, 100, (batch, topk), generator=gen)]
    leaf_scores = logp(batch, topk)
    scores = [leaf_scores]
    parents = [torch.full((batch, topk), -1, dtype=torch.int64)]
    leaf_cand = torch.arange(topk).expand(batch, -1)
    next_cand = topk
    for _ in range(1, steps):
        child_scores = leaf_scores[:, :, None] + logp(batch, topk, topk)
        tokens.append(torch.randint(0, 100, (batch, topk * topk), generator=gen))
        scores.append(child_scores.reshape(batch, -1))
        parents.append(leaf_cand[:, :, None].expand(batch, topk, topk).reshape(batch, -1))
        best = torch.topk(child_scores.reshape(batch, -1), topk, dim=-1)
        leaf_scores = best.values
        leaf_cand = best.indices + next_cand
        next_cand += topk * topk
    return DraftCandidates(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1))


def _cand_depth(cand: DraftCandidates, b: int, c: int) -> int:
    depth = 1
    while int(cand.parents[b, c]) >= 0:
        c = int(cand.parents[b, c])
        depth += 1
    return depth


def _check_shape(tree: DraftTree) -> None:
    """Parents come before their children, the root has none, depths follow the parents."""
    batch, n = tree.tokens.shape
    assert tree.parents.shape == tree.depths.shape == (batch, n)
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == torch.int64
    for b in range(batch):
        parents = tree.parents[b].tolist()
        depths = tree.depths[b].tolist()
        assert parents[0] == -1 and depths[0] == 0
        for i in range(1, n):
            assert 0 <= parents[i] < i
            assert depths[i] == depths[parents[i]] + 1


class TestAncestorMask:
    def test_single_root(self) -> None:
        tree = _tree([[4]], [[-1]])
        assert tree.ancestor_mask().tolist() == [[[True]]]

    def test_star(self) -> None:
        tree = _tree([[0, 1, 2, 3]], [[-1, 0, 0, 0]])
        want = torch.tensor([
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 0, 0, 1],
        ], dtype=torch.bool)
        assert torch.equal(tree.ancestor_mask()[0], want)

    def test_branching_tree(self) -> None:
        #        0
        #      /   \
        #     1     2
        #    / \     \
        #   3   4     5
        #   |
        #   6
        tree = _tree([[9, 1, 2, 3, 4, 5, 6]], [[-1, 0, 0, 1, 1, 2, 3]])
        want = torch.tensor([
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ], dtype=torch.bool)
        assert torch.equal(tree.ancestor_mask()[0], want)
        assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 2, 3]]

    def test_batch_rows_have_their_own_trees(self) -> None:
        tree = _tree([[0, 1, 2, 3], [0, 1, 2, 3]], [[-1, 0, 1, 2], [-1, 0, 0, 1]])
        mask = tree.ancestor_mask()
        assert mask.shape == (2, 4, 4) and mask.dtype == torch.bool
        assert torch.equal(mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
        assert mask[1].int().tolist() == [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1],
        ]

    def test_matches_a_walk_up_the_parents(self) -> None:
        gen = torch.Generator().manual_seed(5)
        cand = _grow(4, 3, 3, gen)
        tree = select_tree(torch.zeros(4, dtype=torch.int64), cand, num_nodes=9)
        mask = tree.ancestor_mask()
        for b, i in itertools.product(range(4), range(9)):
            on_path = set()
            node = i
            while node >= 0:
                on_path.add(node)
                node = int(tree.parents[b, node])
            assert {j for j in range(9) if mask[b, i, j]} == on_path
            # A node sees as many tree nodes as its depth plus one.
            assert int(mask[b, i].sum()) == int(tree.depths[b, i]) + 1


class TestChildren:
    def test_children_in_node_order(self) -> None:
        tree = _tree([[9, 1, 2, 3, 4, 5, 6], [9, 1, 2, 3, 4, 5, 6]],
                     [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 3, 4, 5]])
        assert tree.children(0) == [[1, 2], [3, 4], [5], [6], [], [], []]
        assert tree.children(1) == [[1], [2], [3], [4], [5], [6], []]


class TestChainTree:
    def test_chain(self) -> None:
        roots = torch.tensor([1, 2])
        drafts = torch.tensor([[10, 11, 12], [20, 21, 22]])
        tree = chain_tree(roots, drafts)
        assert tree.num_nodes == 4
        assert tree.tokens.tolist() == [[1, 10, 11, 12], [2, 20, 21, 22]]
        assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2
        assert tree.depths.tolist() == [[0, 1, 2, 3]] * 2
        _check_shape(tree)
        mask = tree.ancestor_mask()
        assert torch.equal(mask, torch.ones(2, 4, 4, dtype=torch.bool).tril().expand(2, -1, -1))
        assert tree.children(1) == [[1], [2], [3], []]

    def test_chain_equals_a_select_tree_of_a_chain(self) -> None:
        # topk 1 drafted as candidates (each the only child of the last) selects to the same
        # tree chain_tree builds.
        roots = torch.tensor([5])
        drafts = torch.tensor([[7, 8, 9, 10]])
        cand = _cands(drafts.tolist(), [[-0.1, -0.3, -0.6, -1.0]], [[-1, 0, 1, 2]])
        selected = select_tree(roots, cand, num_nodes=5)
        chain = chain_tree(roots, drafts)
        for got, want in [(selected.tokens, chain.tokens), (selected.parents, chain.parents),
                          (selected.depths, chain.depths)]:
            assert torch.equal(got, want)

    def test_empty_chain(self) -> None:
        tree = chain_tree(torch.tensor([3]), torch.empty(1, 0, dtype=torch.int64))
        assert tree.tokens.tolist() == [[3]]
        assert tree.parents.tolist() == [[-1]]
        assert tree.depths.tolist() == [[0]]
