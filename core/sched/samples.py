"""n > 1 and best_of: the samples of one prompt are a group of requests.

The first sample (the parent) is admitted and prefills like any request; the others wait in
the queue until its prompt is in the prefix cache, then fork it (`KVManager.can_fork` /
`fork`: a row and a lock on the parent's cached prompt pages) and compute only the rest of
the prompt, at least its last token. Sample j is seeded with `sample_seed(seed, j)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from plugserve.sampling import SamplingParams, sample_seed
from plugserve.structs.req import Req


def run_sampling(sp: SamplingParams) -> SamplingParams:
    """What every sample runs with: best_of > n ranks by cumulative logprob, so it needs
    each token's logprob (the result drops them again when they were not asked for)."""
    if sp.best_of is not None and sp.best_of > sp.n and not sp.logprobs:
        return replace(sp, logprobs=True)
    return sp


def add_samples(parent: Req, next_rid: Callable[[], int], forks_prompts: bool) -> list[Req]:
    """Make samples 1.. of the parent's group (it is sample 0); returns them, to be queued
    right after the parent. When they fork the parent's prompt, only the parent computes
    the prompt's logprobs (its results carry them for every sample)."""
    sp = parent.sampling
    children = []
    for j in range(1, sp.num_samples):
        child_sp = replace(sp, seed=sample_seed(sp.seed, j),
                           prompt_logprobs=None if forks_prompts else sp.prompt_logprobs)
        child = Req(next_rid(), parent.origin_input_ids, child_sp)
        child.sample_index, child.fork_parent = j, parent
        child.logprobs_asked = parent.logprobs_asked
        child.grammar_future = parent.grammar_future  # one compile; a matcher per sample
        children.append(child)
    parent.group.extend(children)
    return children


def samples_problems(sp: SamplingParams, session_id: str | None, streaming: bool) -> list[str]:
    """Why these samples cannot run here (the counts themselves are SamplingParams')."""
    if sp.sample_count_problems():
        return []  # reported by SamplingParams.problems
    out = []
    if session_id is not None and sp.num_samples > 1:
        out.append(f"n={sp.n}, best_of={sp.best_of}: a streaming-session turn takes one "
                   "sample (its KV becomes the session's); send n=1")
    if streaming and sp.best_of is not None and sp.best_of > sp.n:
        out.append(f"best_of={sp.best_of} > n={sp.n} cannot be streamed: the best samples are "
                   "known only when all finished; leave stream off or send best_of=n")
    return out
