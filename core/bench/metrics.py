"""Serving metrics of one benchmark run, computed from the engine's finished `Req` objects.

Per request the scheduler records `created_s` (submit), `first_token_s`, `token_times_s`
(arrival time of every output token) and `finished_s`. From them:

- TTFT: `first_token_s - created_s`; mean, median, p99 over requests.
- ITL: the gaps between successive token arrival times of a request, pooled over all
  requests; mean, median, p95, p99. Tokens that arrive together (one speculative verify round
  emits several at once) have a gap of 0.
- TPOT: `(latency - ttft) / (output_tokens - 1)` per request with at least two tokens; mean.
- Step time: the engine's `step_time_s` phases grouped into schedule, metadata, forward,
  sample, post-process, check (and the speculative phases when present), as seconds and as
  fractions of their sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugserve.structs.req import Req

# Group name -> the raw `step_time_s` keys it sums. `prepare` (building the batch tensors on
# the host) and `metadata` (the attention backend's per-batch metadata) are both metadata.
STEP_GROUPS: dict[str, tuple[str, ...]] = {
    "schedule": ("schedule",),
    "metadata": ("prepare", "metadata"),
    "forward": ("forward",),
    "sample": ("sample",),
    "draft": ("draft",),
    "verify": ("verify",),
    "accept": ("accept",),
    "draft_extend": ("draft_extend",),
    "post_process": ("post_process",),
    "check": ("check",),
}
# Spans that contain other phases, not phases of their own: `run` is the synchronous loop's
# launch-to-result span (prepare + the model phases), `wait` the overlap loop's time blocked
# on the worker thread.
CONTAINER_KEYS = ("run", "wait")
RUNNER_KEYS = ("prepare", "metadata", "forward", "sample", "draft", "verify", "accept",
               "draft_extend")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _summary(values: Sequence[float], quantiles: Iterable[int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": mean(values), "median": percentile(values, 50)}
    for q in quantiles:
        out[f"p{q}"] = percentile(values, q)
    return out


def ttft_values(reqs: Sequence[Req]) -> list[float]:
    return [r.first_token_s - r.created_s for r in reqs if r.first_token_s is not None]


def itl_values(reqs: Sequence[Req]) -> list[float]:
    gaps: list[float] = []
    for r in reqs:
        times = r.token_times_s
        gaps.extend(b - a for a, b in pairwise(times))
    return gaps


def tpot_values(reqs: Sequence[Req]) -> list[float]:
    out: list[float] = []
    for r in reqs:
        n = len(r.output_ids)
        if n > 1 and r.first_token_s is not None and r.finished_s is not None:
            out.append((r.finished_s - r.first_token_s) / (n - 1))
    return out


def latency_metrics(reqs: Sequence[Req]) -> dict[str, Any]:
    return {
        "ttft_s": _summary(ttft_values(reqs), (99,)),
        "itl_s": _summary(itl_values(reqs), (95, 99)),
        "tpot_s": {"mean": mean(tpot_values(reqs))},
    }


def throughput_metrics(reqs: Sequence[Req], seconds: float) -> dict[str, Any]:
    prompt = sum(len(r.origin_input_ids) for r in reqs)
    output = sum(len(r.output_ids) for r in reqs)
    return {
        "requests": len(reqs),
        "seconds": seconds,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "request_per_s": len(reqs) / seconds if seconds > 0 else None,
        "input_tok_per_s": prompt / seconds if seconds > 0 else None,
        "output_tok_per_s": output / seconds if seconds > 0 else None,
    }


def step_breakdown(step_time_s: Mapping[str, float]) -> dict[str, Any]:
    """Group the raw phase times; fractions are of the groups' sum.

    In the synchronous loop, `run` minus the runner's own phases is reported as `other`
    (Python glue around the forward). In the overlap loop the model phases run on a worker
    thread while the scheduler works, so the sum can exceed the wall time.
    """
    raw = {k: float(v) for k, v in step_time_s.items()}
    groups: dict[str, float] = {}
    for name, keys in STEP_GROUPS.items():
        if any(k in raw for k in keys):
            groups[name] = sum(raw.get(k, 0.0) for k in keys)
    known = {k for keys in STEP_GROUPS.values() for k in keys} | set(CONTAINER_KEYS)
    for key in sorted(set(raw) - known):  # a phase a newer engine or plugin adds
        groups[key] = raw[key]
    if "grammar_mask" in raw and "sample" in groups:
        # The grammar mask runs inside the sample phase: shown on its own, not twice.
        groups["sample"] = max(0.0, groups["sample"] - raw["grammar_mask"])
    if "run" in raw:
        inside = sum(raw.get(k, 0.0) for k in RUNNER_KEYS)
        groups["other"] = max(0.0, raw["run"] - inside)
    total = sum(groups.values())
    return {
        "total_s": total,
        "groups": {
            name: {"seconds": s, "fraction": s / total if total > 0 else None}
            for name, s in groups.items()
        },
        "raw": raw,
    }


def spec_metrics(reqs: Sequence[Req]) -> dict[str, Any]:
    """Acceptance length and target forwards per output token.

    Acceptance length: tokens per verify round, `(accepted + rounds) / rounds`, pooled over
    requests. Target forwards per output token, per request: `(1 + verify rounds) / output
    tokens` (the prefill counts as one forward; without speculation every token after the
    first costs one decode forward, so that is 1.0); the mean over requests.
    """
    rounds = sum(r.spec_verify_steps for r in reqs)
    accepted = sum(r.spec_accepted_tokens for r in reqs)
    per_req: list[float] = []
    for r in reqs:
        n = len(r.output_ids)
        if n == 0:
            continue
        forwards = 1 + r.spec_verify_steps if r.spec_verify_steps else n
        per_req.append(forwards / n)
    hist: dict[int, int] = {}
    for r in reqs:
        for length, count in r.spec_accept_hist.items():
            hist[length] = hist.get(length, 0) + count
    return {
        "verify_rounds": rounds,
        "accepted_tokens": accepted,
        "accept_len": (accepted + rounds) / rounds if rounds else None,
        "accept_hist": {str(k): hist[k] for k in sorted(hist)},
        "target_forwards_per_token": mean(per_req),
    }
