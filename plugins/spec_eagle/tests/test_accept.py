"""Acceptance of a verified draft tree (`accept_all`), greedy and sampled.

Greedy: the path that follows the target's argmax, the bonus token, logprobs.
Sampling: on a small synthetic case with fixed target logits, the tokens a round emits are
distributed exactly as the target's own sampling draws them: many seeded trials (deterministic,
so nothing can flake), their empirical distribution of the first token and of the first two
tokens compared with the exact target probabilities by total variation distance, against a
bound computed for the sample size. Then the engine: seeded speculative sampling with the
checker on, and the distribution of the first speculative round's token on the tiny model.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import MAX_NEW, NUM_STEPS, PROMPTS
from plugserve.engine import Engine
from plugserve.pools.kv_pool import KVPool
from plugserve.runner.sampler import sampling_probs
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve_spec_eagle.accept import accept_all
from plugserve_spec_eagle.drafter import CatchUp
from plugserve_spec_eagle.state import EagleReqState
from plugserve_spec_eagle.tree import DraftTree

Nodes = list[tuple[int, int]]  # (parent node, token) of nodes 1.., node 0 is the root


def _tree(root: int, nodes: Nodes, batch: int = 1) -> DraftTree:
    tokens = [root] + [tok for _, tok in nodes]
    parents = [-1] + [par for par, _ in nodes]
    depths = [0]
    for par, _ in nodes:
        depths.append(depths[par] + 1)

    def rows(values: list[int]) -> torch.Tensor:
        return torch.tensor([values], dtype=torch.int64).expand(batch, -1)

    return DraftTree(rows(tokens), rows(parents), rows(depths))


def _prefixes(nodes: Nodes) -> list[tuple[int, ...]]:
    """The tokens after the root on the path to each node (the node's context)."""
    out: list[tuple[int, ...]] = [()]
    for par, tok in nodes:
        out.append((*out[par], tok))
    return out


def _one_hot_logits(vocab: int, want: int, runner_up: int | None = None) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[want] = 5.0
    if runner_up is not None:
        row[runner_up] = 4.0
    return row


# --- greedy ---------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0)
V = 8

#        0 (root 7)
#      /     |     \
#   1:tok2  2:tok3  3:tok4
#   /   \      |
# 4:5   5:6   6:1
#        |
#       7:0
BRANCHY: Nodes = [(0, 2), (0, 3), (0, 4), (1, 5), (1, 6), (2, 1), (5, 0)]


class TestGreedy:
    def _accept(self, nodes: Nodes, argmax: list[int]) -> Any:
        tree = _tree(7, nodes)
        logits = torch.stack([_one_hot_logits(V, a, (a + 1) % V) for a in argmax])[None]
        return accept_all(tree, logits, [GREEDY], [None])[0]

    def test_longest_matching_path(self) -> None:
        # The target wants 2, then 6, then 0, then 3: path 0 -> 1 -> 5 -> 7, bonus 3.
        argmax = [2, 6, 0, 0, 0, 0, 0, 3]
        got = self._accept(BRANCHY, argmax)
        assert got.path == [0, 1, 5, 7]
        assert got.tokens == [2, 6, 0, 3]

    def test_later_sibling(self) -> None:
        # The target wants 3 at the root (the second child) then 1, then 4 (no child): bonus 4.
        argmax = [3, 0, 1, 0, 0, 0, 4, 0]
        got = self._accept(BRANCHY, argmax)
        assert got.path == [0, 2, 6]
        assert got.tokens == [3, 1, 4]

    def test_last_sibling_leaf(self) -> None:
        argmax = [4, 0, 0, 5, 0, 0, 0, 0]
        got = self._accept(BRANCHY, argmax)
        assert got.path == [0, 3]
        assert got.tokens == [4, 5]  # the bonus is the argmax at node 3

    def test_nothing_matches(self) -> None:
        argmax = [6, 5, 1, 0, 0, 0, 0, 0]
        got = self._accept(BRANCHY, argmax)
        assert got.path == [0]
        assert got.tokens == [6]

    def test_stops_where_a_child_mismatches(self) -> None:
        # Node 1 (token 2) matches; at node 1 the target wants 7, neither 5 nor 6.
        argmax = [2, 7, 0, 0, 0, 0, 0, 0]
        got = self._accept(BRANCHY, argmax)
        assert got.path == [0, 1]
        assert got.tokens == [2, 7]

    def test_chain(self) -> None:
        chain: Nodes = [(0, 1), (1, 2), (2, 3)]
        full = self._accept(chain, [1, 2, 3, 4])
        assert full.path == [0, 1, 2, 3] and full.tokens == [1, 2, 3, 4]
        half = self._accept(chain, [1, 2, 5, 4])
        assert half.path == [0, 1, 2] and half.tokens == [1, 2, 5]

    def test_logprobs_are_taken_where_each_token_was_chosen(self) -> None:
        tree = _tree(7, BRANCHY)
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(1, len(BRANCHY) + 1, V, generator=gen) * 3
        # Make the argmax follow 0 -> 2 -> 6 and stop there.
        logits[0, 0, 3] = 20.0
        logits[0, 2, 1] = 20.0
        got = accept_all(tree, logits, [GREEDY], [None])[0]
        assert got.path == [0, 2, 6]
        bonus = int(logits[0, 6].argmax())
        assert got.tokens == [3, 1, bonus]
        logp = torch.log_softmax(logits[0], dim=-1)
        want = [float(logp[0, 3]), float(logp[2, 1]), float(logp[6, bonus])]
        assert got.logprobs == pytest.approx(want, abs=1e-6)

    def test_batch_rows_are_independent(self) -> None:
        tree = _tree(7, BRANCHY, batch=3)
        rows = [[2, 6, 0, 0, 0, 0, 0, 3], [3, 0, 1, 0, 0, 0, 4, 0], [6, 0, 0, 0, 0, 0, 0, 0]]
        logits = torch.stack([torch.stack([_one_hot_logits(V, a) for a in r]) for r in rows])
        got = accept_all(tree, logits, [GREEDY] * 3, [None] * 3)
        assert [a.path for a in got] == [[0, 1, 5, 7], [0, 2, 6], [0]]
        assert [a.tokens for a in got] == [[2, 6, 0, 3], [3, 1, 4], [6]]

    def test_greedy_rows_ignore_sampled_neighbours(self) -> None:
        # A batch mixing a greedy and a sampled request: the greedy row stays greedy.
        tree = _tree(7, BRANCHY, batch=2)
        argmax = [3, 0, 1, 0, 0, 0, 4, 0]
        one = torch.stack([_one_hot_logits(V, a) for a in argmax])
        logits = torch.stack([one, torch.zeros_like(one)])
        hot = SamplingParams(temperature=1.0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            got = accept_all(tree, logits, [GREEDY, hot], [None, gen])
            assert got[0].tokens == [3, 1, 4]
            assert all(0 <= t < V for t in got[1].tokens)


# --- sampling: exact in distribution --------------------------------------------------------

VOCAB = 6
ROOT = 5
TEMPERATURE = 0.8
# The target's sampling distribution at the root (at TEMPERATURE, before top-k/top-p): the
# drafted children of the root carry most of it, as with a draft that knows the target.
ROOT_PROBS = [0.05, 0.30, 0.05, 0.25, 0.20, 0.15]
# Round 1: a tree the way a draft grows one (three children of the root, children of the
# first two, one grandchild deeper). Token 0 is drafted although the target rarely wants it
# (and with top-k 4 never: it must never be accepted then).
#            0 (root)
#       /      |      \
#    1:tok1  2:tok4  3:tok0
#    /   \      |
#  4:3   5:2   6:5
#   |
#  7:4
ROUND1: Nodes = [(0, 1), (0, 4), (0, 0), (1, 3), (1, 2), (2, 5), (4, 4)]


def _round2(first: int) -> Nodes:
    """The tree of the round after a round that emitted only `first`: two children."""
    return [(0, (first + 1) % VOCAB), (0, (first + 2) % VOCAB)]


def target_logits(context: tuple[int, ...]) -> torch.Tensor:
    """The synthetic target: fixed logits for every context after the root (the root's give
    ROOT_PROBS at TEMPERATURE; the others are seeded pseudo-random)."""
    if not context:
        return TEMPERATURE * torch.tensor(ROOT_PROBS).log()
    seed = 7919 + sum((tok + 1) * 31 ** (i + 1) for i, tok in enumerate(context))
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))


def _tree_logits(nodes: Nodes, context: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([target_logits(context + p) for p in _prefixes(nodes)])


def _run_round(nodes: Nodes, context: tuple[int, ...], trials: int, params: SamplingParams,
               gen: torch.Generator) -> list[list[int]]:
    tree = _tree(ROOT, nodes, batch=trials)
    logits = _tree_logits(nodes, context)[None].expand(trials, -1, -1)
    accepted = accept_all(tree, logits, [params] * trials, [gen] * trials)
    # The logprob of every emitted token: log_softmax of the raw logits where it was chosen.
    logp = torch.log_softmax(logits[0], dim=-1).tolist()
    for a in accepted:
        want = [logp[node][tok] for node, tok in zip(a.path, a.tokens, strict=True)]
        assert a.logprobs == pytest.approx(want, abs=1e-5)
    return [a.tokens for a in accepted]


def simulate(trials: int, params: SamplingParams, seed: int) -> list[tuple[int, int]]:
    """The first two emitted tokens of `trials` speculative generations: round 1 on ROUND1;
    where it emitted a single token, round 2 on a tree rooted at that token."""
    gen = torch.Generator().manual_seed(seed)
    first = _run_round(ROUND1, (), trials, params, gen)
    pairs: list[tuple[int, int] | None] = [(t[0], t[1]) if len(t) > 1 else None for t in first]
    for tok in range(VOCAB):
        waiting = [i for i, t in enumerate(first) if len(t) == 1 and t[0] == tok]
        if not waiting:
            continue
        second = _run_round(_round2(tok), (tok,), len(waiting), params, gen)
        for i, toks in zip(waiting, second, strict=True):
            pairs[i] = (tok, toks[0])
    assert all(p is not None for p in pairs)
    return [p for p in pairs if p is not None]


def exact_pairs(params: SamplingParams) -> dict[tuple[int, int], float]:
    q0 = sampling_probs(target_logits(()), params)
    out = {}
    for a in range(VOCAB):
        q1 = sampling_probs(target_logits((a,)), params)
        for b in range(VOCAB):
            out[(a, b)] = float(q0[a] * q1[b])
    return out


def tv_bound(support: int, trials: int, alpha: float = 1e-6) -> float:
    """Total variation a correct sampler exceeds with probability below `alpha`:
    P(||p_hat - p||_1 >= eps) <= (2^K - 2) exp(-n eps^2 / 2) (Weissman et al. 2003), and
    TV = ||.||_1 / 2."""
    return math.sqrt((support * math.log(2) + math.log(1 / alpha)) / (2 * trials))


def tv(counts: Counter[Any], exact: dict[Any, float], trials: int) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / trials - exact.get(k, 0.0)) for k in keys)


def first_token_if_wrong(params: SamplingParams, rule: str) -> dict[int, float]:
    """The first-token distribution of a *wrong* acceptance rule, exactly: used to show the
    sample size tells the rule under test from a subtly broken one.

    "no_renormalise": each child of the root is tested against the target's original
    probability (a rejected token is not removed and the rest not rescaled);
    "bonus_keeps_rejected": children are tested correctly, but the bonus token is drawn from
    the whole target distribution (rejected children included).
    """
    q = sampling_probs(target_logits(()), params).tolist()
    children = [tok for par, tok in ROUND1 if par == 0]
    out = dict.fromkeys(range(VOCAB), 0.0)
    left = 1.0  # probability that every child so far was rejected
    residual = list(q)
    for tok in children:
        if rule == "no_renormalise":
            accept = q[tok]
        else:
            accept = residual[tok]
            residual[tok] = 0.0
            total = sum(residual)
            residual = [r / total for r in residual]
        out[tok] += left * accept
        left *= 1 - accept
    bonus = residual if rule == "no_renormalise" else q
    if rule == "no_renormalise":
        for tok in children:
            bonus[tok] = 0.0
        total = sum(bonus)
        bonus = [b / total for b in bonus]
    for tok in range(VOCAB):
        out[tok] += left * bonus[tok]
    return out


CASES = {
    # name: (params, trials); bounds at these sizes: 0.027 (first token) and 0.040 (pairs),
    # resp. 0.032 and 0.035 (top-k/top-p: smaller supports).
    "temperature": (SamplingParams(temperature=TEMPERATURE), 12_000),
    # top-k 4 leaves out a drafted token (probability 0: never accepted); top-p trims more.
    "top_k_top_p": (SamplingParams(temperature=TEMPERATURE, top_k=4, top_p=0.8), 8_000),
}


@dataclass
class Sampled:
    params: SamplingParams
    trials: int
    pairs: list[tuple[int, int]]  # the first two tokens of every trial


@pytest.fixture(scope="module", params=list(CASES))
def sampled(request: pytest.FixtureRequest) -> Sampled:
    params, trials = CASES[request.param]
    return Sampled(params, trials, simulate(trials, params, seed=1234))


class TestSampledDistribution:
    def test_first_token(self, sampled: Sampled) -> None:
        exact = dict(enumerate(sampling_probs(target_logits(()), sampled.params).tolist()))
        support = sum(1 for p in exact.values() if p > 0)
        counts = Counter(a for a, _ in sampled.pairs)
        assert all(exact[t] > 0 for t in counts), "a token outside the target's support"
        bound = tv_bound(support, sampled.trials)
        assert tv(counts, exact, sampled.trials) < bound
        # The bound is tight enough to catch plausible bugs in the rule.
        for rule in ("no_renormalise", "bonus_keeps_rejected"):
            wrong = first_token_if_wrong(sampled.params, rule)
            assert abs(sum(wrong.values()) - 1) < 1e-6
            assert 0.5 * sum(abs(wrong[t] - exact[t]) for t in exact) > 2 * bound, rule

    def test_first_two_tokens(self, sampled: Sampled) -> None:
        exact = exact_pairs(sampled.params)
        support = sum(1 for p in exact.values() if p > 0)
        counts = Counter(sampled.pairs)
        assert all(exact[pair] > 0 for pair in counts), "a pair outside the target's support"
        assert tv(counts, exact, sampled.trials) < tv_bound(support, sampled.trials)

    def test_rounds_accept_draft_tokens(self, sampled: Sampled) -> None:
        # The case exercises acceptance, not just the bonus path: most first tokens are
        # drafted children of the root.
        drafted = {tok for par, tok in ROUND1 if par == 0}
        assert sum(a in drafted for a, _ in sampled.pairs) > 0.5 * sampled.trials

    def test_out_of_support_child_never_accepted(self, sampled: Sampled) -> None:
        q = sampling_probs(target_logits(()), sampled.params)
        outside = [tok for par, tok in ROUND1 if par == 0 and float(q[tok]) == 0.0]
        if sampled.params.top_k > 0:
            assert outside == [0]
        assert all(a not in outside for a, _ in sampled.pairs)


def test_top_k_1_sampling_is_greedy() -> None:
    # A sampled request whose distribution is a point mass accepts exactly the greedy path.
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.7, top_k=1)
    tree = _tree(ROOT, ROUND1, batch=200)
    logits = _tree_logits(ROUND1, ())[None].expand(200, -1, -1)
    greedy = accept_all(_tree(ROOT, ROUND1), logits[:1], [GREEDY], [None])[0]
    for a in accept_all(tree, logits, [params] * 200, [gen] * 200):
        assert a.path == greedy.path
        assert a.tokens == greedy.tokens


def test_same_generator_state_same_result() -> None:
    params = SamplingParams(temperature=1.0)
    tree = _tree(ROOT, ROUND1, batch=64)
    logits = _tree_logits(ROUND1, ())[None].expand(64, -1, -1)
    runs = []
    for _ in range(2):
        gens: list[torch.Generator | None] = [torch.Generator().manual_seed(i) for i in range(64)]
        runs.append([a.tokens for a in accept_all(tree, logits, [params] * 64, gens)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 1


# --- the engine -----------------------------------------------------------------------------


def _sampled(seed: int, max_new: int = MAX_NEW, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=TEMPERATURE, seed=seed,
                          ignore_eos=True, **kw)


SEEDED = [_sampled(100 + i) for i in range(len(PROMPTS))]
# (page_size, topk, loop)
ENGINE_CASES = [(1, 1, "normal"), (1, 4, "overlap"), (16, 4, "normal"), (16, 2, "overlap")]


class TestEngineSampling(EngineTest):
    def spec_engine(self, target_dir: Path, head_dir: Path, page: int, topk: int, loop: str,
                    **kw: Any) -> Engine:
        return self.engine(
            model=str(target_dir), dtype="float32", page_size=page, chunked_prefill_size=16,
            overlap=loop == "overlap", spec="eagle", draft_model=str(head_dir),
            spec_steps=NUM_STEPS, spec_topk=topk, **kw,
        )

    @pytest.mark.parametrize(("page", "topk", "loop"), ENGINE_CASES,
                             ids=[f"page{p}-topk{k}-{lp}" for p, k, lp in ENGINE_CASES])
    def test_seeded_sampling(self, target_dir: Path, trained_head_dir: Path, page: int,
                             topk: int, loop: str) -> None:
        with self.spec_engine(target_dir, trained_head_dir, page, topk, loop) as engine:
            first = engine.generate(PROMPTS, SEEDED)
            self.assert_idle_memory_whole(engine)
            again = engine.generate(PROMPTS, SEEDED)  # warm prefix cache, same seeds
            self.assert_idle_memory_whole(engine)
        for r in first:
            assert r.error is None
            assert r.output_tokens == MAX_NEW and len(r.token_ids) == MAX_NEW
            assert r.finish_reason == "length"
            stats = r.stats
            assert stats["spec_verify_steps"] == sum(stats["spec_accept_hist"].values())
            assert stats["spec_accepted_tokens"] == sum(
                (n - 1) * c for n, c in stats["spec_accept_hist"].items())
            assert all(1 <= n <= NUM_STEPS + 1 for n in stats["spec_accept_hist"])
        assert [r.token_ids for r in again] == [r.token_ids for r in first]
        # Sampling, not greedy: different seeds of one prompt give different outputs.
        assert len({tuple(r.token_ids) for r in first}) == len(PROMPTS)

    def test_same_seed_same_output_across_loops_and_pages(
        self, target_dir: Path, trained_head_dir: Path
    ) -> None:
        """A request's random stream is its own: the loop, the page size and the batch it
        shares do not change what a seed produces (for a fixed topk)."""
        outputs = []
        for page, loop in [(1, "normal"), (16, "overlap")]:
            with self.spec_engine(target_dir, trained_head_dir, page, 4, loop) as engine:
                outputs.append([r.token_ids for r in engine.generate(PROMPTS, SEEDED)])
                alone = engine.generate([PROMPTS[2]], SEEDED[2])
                outputs.append([*outputs[-1][:2], alone[0].token_ids, outputs[-1][3]])
                self.assert_idle_memory_whole(engine)
        assert all(o == outputs[0] for o in outputs)

    def test_accepted_some_draft_tokens(self, target_dir: Path, trained_head_dir: Path) -> None:
        # Temperature 0.8 on the tiny target still leaves the trained head something to get
        # right: sampling accepts draft tokens, not only bonus tokens.
        with self.spec_engine(target_dir, trained_head_dir, 1, 4, "normal") as engine:
            results = engine.generate(PROMPTS, SEEDED)
        assert sum(r.stats["spec_accepted_tokens"] for r in results) > 0

    def test_greedy_logprobs_match_plain(self, target_dir: Path, trained_head_dir: Path,
                                         reference: list[list[int]]) -> None:
        greedy = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=True)
        with self.engine(model=str(target_dir), dtype="float32") as plain:
            want = plain.generate(PROMPTS, greedy)
        with self.spec_engine(target_dir, trained_head_dir, 16, 4, "overlap") as engine:
            got = engine.generate(PROMPTS, greedy)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert g.logprobs is not None and w.logprobs is not None
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


ROUND_REQUESTS = 1536
ROUND_PROMPT = [(37 * i + 11) % 250 + 3 for i in range(10)]
ROUND_PARAMS = SamplingParams(temperature=TEMPERATURE, top_k=3)

Logits = Callable[[tuple[int, ...]], torch.Tensor]


@pytest.fixture(scope="module")
def hf_logits(target_dir: Path) -> Logits:
    """The target's next-token logits after a context, from transformers (memoised)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.eval()
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(context: tuple[int, ...]) -> torch.Tensor:
        if context not in memo:
            with torch.inference_mode():
                memo[context] = model(torch.tensor([context])).logits[0, -1].float()
        return memo[context]

    return logits


class TargetDrafter:
    """A drafter double that knows the target: the root's children are the target's top-k
    tokens, every deeper node the target's argmax after its path (breadth first, up to the
    verify budget). Sampled requests then accept often, and reject too (the k-th child lies
    outside a top-k-3 support)."""

    def __init__(self, logits: Logits, num_steps: int, topk: int, num_draft_tokens: int) -> None:
        self.logits = logits
        self.num_steps = num_steps
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens

    @property
    def kv_pools(self) -> list[KVPool]:
        return []

    def catch_up(self, batch: CatchUp) -> None:
        return None

    def _nodes(self, context: tuple[int, ...]) -> Nodes:
        first = torch.topk(self.logits(context), self.topk).indices.tolist()
        nodes: Nodes = [(0, tok) for tok in first]
        paths: list[tuple[int, ...]] = [(tok,) for tok in first]
        node = 1
        while len(nodes) < self.num_draft_tokens - 1:
            path = paths[node - 1]
            assert len(path) < self.num_steps, "the tree budget outgrew the draft depth"
            nodes.append((node, int(self.logits(context + path).argmax())))
            paths.append((*path, nodes[-1][1]))
            node += 1
        return nodes

    def draft(self, row_ids: torch.Tensor, rows: list[torch.Tensor],
              states: list[EagleReqState]) -> DraftTree:
        trees = [_tree(s.last_token, self._nodes(tuple(s.token_ids))) for s in states]
        return DraftTree(*(torch.cat([getattr(t, f) for t in trees])
                           for f in ("tokens", "parents", "depths")))


class TestEngineRoundDistribution(EngineTest):
    # The trained head rarely gets a token of this prompt right (TestEngineSampling covers
    # it); a drafter that knows the target exercises acceptance as well as rejection.
    @pytest.mark.parametrize(("drafter", "topk"), [("target", 1), ("target", 4)])
    def test_first_speculative_token(
        self, target_dir: Path, trained_head_dir: Path, drafter: str, topk: int,
        hf_logits: Logits,
    ) -> None:
        """Many seeded requests of one prompt, two tokens each: the first comes from the
        prefill's sampler, the second from the first speculative round. Their joint
        distribution must be the target's: p(t1 | prompt) * p(t2 | prompt, t1)."""
        params = [replace(ROUND_PARAMS, max_new_tokens=2, seed=seed, ignore_eos=True)
                  for seed in range(ROUND_REQUESTS)]
        with self.engine(
            model=str(target_dir), dtype="float32", spec="eagle",
            draft_model=str(trained_head_dir), spec_steps=NUM_STEPS, spec_topk=topk,
        ) as engine:
            if drafter == "target":
                engine.spec.drafter = TargetDrafter(
                    hf_logits, NUM_STEPS, topk, engine.config.num_draft_tokens)
            results = engine.generate([ROUND_PROMPT] * ROUND_REQUESTS, params)
            self.assert_idle_memory_whole(engine)
        assert all(r.stats["spec_verify_steps"] >= 1 for r in results)
        counts = Counter((r.token_ids[0], r.token_ids[1]) for r in results)
        prompt = tuple(ROUND_PROMPT)
        q0 = sampling_probs(hf_logits(prompt), ROUND_PARAMS)
        exact: dict[tuple[int, int], float] = {}
        for a in torch.nonzero(q0).flatten().tolist():
            q1 = sampling_probs(hf_logits((*prompt, a)), ROUND_PARAMS)
            for b in torch.nonzero(q1).flatten().tolist():
                exact[(a, b)] = float(q0[a] * q1[b])
        assert set(counts) <= set(exact), "a pair outside the target's top-k support"
        assert tv(counts, exact, ROUND_REQUESTS) < tv_bound(len(exact), ROUND_REQUESTS)
        if drafter == "target":
            emitted = Counter(n for r in results for n in r.stats["spec_accept_hist"])
            accepted = sum(c for n, c in emitted.items() if n > 1)
            if topk >= ROUND_PARAMS.top_k:
                # The root's children cover the whole top-k support: a child is always taken.
                assert emitted[1] == 0 and accepted == ROUND_REQUESTS
            else:
                # Both ways out of the round: the draft token accepted, or rejected.
                assert emitted[1] > 0 and accepted > 0
