"""Engine runs shared by the cache-policy and speculative-algorithm suites: greedy generation
through the public `Engine` API, token comparison with a readable first difference, and the
proof that the invariant checker ran and memory is whole at idle."""

from __future__ import annotations

from typing import Any

from plugserve.sampling import SamplingParams
from plugserve.testing.memory import assert_memory_whole


def greedy(max_new: list[int]) -> list[SamplingParams]:
    """Greedy sampling, EOS ignored, `max_new[i]` new tokens for prompt i."""
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]


def first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    """Where two lists of outputs first differ, for an assertion message."""
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            same = [a == b for a, b in zip(g, w, strict=False)]
            at = same.index(False) if False in same else min(len(g), len(w))
            return (f"request {i} differs first at new token {at} (of {len(w)}): got "
                    f"{g[at:at + 4]}, expected {w[at:at + 4]}")
    return "no difference"


def generate_greedy(engine: Any, prompts: list[list[int]], max_new: list[int],
                    **kwargs: Any) -> list[Any]:
    """`engine.generate` greedily; every request must succeed. Returns the results."""
    results = engine.generate(prompts, greedy(max_new), **kwargs)
    errors = [f"request {i}: {r.error}" for i, r in enumerate(results) if r.error]
    assert not errors, f"requests failed: {errors}"
    return list(results)


def assert_tokens(got: list[list[int]], want: list[list[int]], what: str) -> None:
    assert got == want, f"{what}: {first_difference(got, want)}"


def assert_checked_and_whole(engine: Any) -> None:
    """The invariant checker ran (at level 1 it checks every busy step and every idle) and
    the memory is whole now, at idle."""
    checked = engine.stats().get("checker", {}).get("steps_checked", 0)
    assert checked > 0, "the invariant checker did not run (mem_check must be on)"
    assert_memory_whole(engine)
