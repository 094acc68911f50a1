"""Workload `sessions`: S multi-turn conversations x T turns, streaming sessions against
re-sending the whole history to the radix cache.

Each turn of each conversation adds `turn_input_len` random token ids (`random.Random(seed)`,
0..10000) and asks for `turn_output_len` tokens, greedy, EOS ignored. Every round advances all
S conversations by one turn together: S requests are submitted, then the scheduler runs until
idle, so a round's turns run batched. Two runs, on two engines started together whose rounds
alternate (so other work on the machine slows both alike):

- `sessions` (`cache=streaming_session`): one session per conversation; a turn sends only its
  new tokens (`engine.submit(new, session_id=...)`), the session keeps the KV between turns.
- `resend` (`cache=radix`, no session): a turn sends the whole conversation so far (every
  earlier prompt and reply) plus its new tokens; the radix cache finds what it can.

With `background_prompts` B > 0, after each round (while the users read the replies) both
engines also serve B one-shot requests of `background_len` fresh random tokens (one output
token each): other users' traffic, not timed. With a KV pool (`--kv-pool-tokens`) that holds
the conversations but not also everything the traffic leaves behind, the radix cache evicts
the least recently used first, which is now the histories, so re-sending recomputes them; a
session holds its history whatever the traffic does.

Per turn (mean over the S conversations): latency (submit to last token), TTFT, prompt tokens
and prefill tokens computed (the engine's `prefill_tokens` over the round / S). Reported: the
mean latency of the first and of the last `HEAD_TURNS` turns and their ratio. Targets
(reported, not enforced): with sessions, tail / head <= 1.10 and every later turn computes
its new tokens and at most the previous reply's last token; a lower tail latency than resend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plugserve.bench.metrics import mean
from plugserve.bench.runner import (
    BenchOptionsError,
    Measured,
    RequestRejectedError,
    check_complete,
    derive,
    new_report,
)
from plugserve.bench.throughput import TOKEN_ID_MAX

if TYPE_CHECKING:
    from plugserve.bench.hf import Comparison
    from plugserve.bench.runner import Runner
    from plugserve.config import EngineConfig
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams
    from plugserve.structs.req import Req

NAME = "sessions"
RUNS = {"sessions": "streaming_session", "resend": "radix"}  # run label -> cache policy
ENGINE_FIELDS_SET = ("cache",)
HEAD_TURNS = 10  # turns averaged at the head and at the tail
RATIO_TARGET = 1.10  # tail / head mean turn latency, with sessions
TTFT_TARGET = 0.5  # late-turn TTFT with sessions / with re-sending


@dataclass(frozen=True)
class SessionsOptions:
    sessions: int = 8
    turns: int = 32
    turn_input_len: int = 32
    turn_output_len: int = 32
    seed: int = 0
    background_prompts: int = 0  # one-shot requests of other users, per round
    background_len: int = 512  # tokens of each

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "turn_input_len", "turn_output_len",
                     "background_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.background_prompts < 0:
            raise ValueError(f"background_prompts must be >= 0, got {self.background_prompts}")

    @property
    def conversation_len(self) -> int:
        return self.turns * (self.turn_input_len + self.turn_output_len)


def make_turns(options: SessionsOptions) -> list[list[list[int]]]:
    """turns[s][t]: the new tokens of conversation s's turn t."""
    rng = random.Random(options.seed)
    return [[[rng.randint(0, TOKEN_ID_MAX) for _ in range(options.turn_input_len)]
             for _ in range(options.turns)] for _ in range(options.sessions)]


def make_background(options: SessionsOptions, turn: int) -> list[list[int]]:
    """Round `turn`'s one-shot prompts: fresh random ids, the same for both engines."""
    rng = random.Random(f"{options.seed}/background/{turn}")
    return [[rng.randint(0, TOKEN_ID_MAX) for _ in range(options.background_len)]
            for _ in range(options.background_prompts)]


def engine_configs(base: EngineConfig, options: SessionsOptions) -> dict[str, EngineConfig]:
    # one turn of each conversation (or the round's background) at once
    rows = max(base.max_running_requests, options.sessions, options.background_prompts)
    # Both engines run at once: a KV pool for the conversations, not the default budget.
    pool = base.kv_pool_tokens or options.sessions * (options.conversation_len + 64) + 1024
    return {label: derive(base, cache=cache, max_running_requests=rows, kv_pool_tokens=pool)
            for label, cache in RUNS.items()}


def run(runner: Runner, options: SessionsOptions, comparison: Comparison | None) -> dict[str, Any]:
    if comparison is not None:
        raise BenchOptionsError("bench sessions has no --compare: it compares sessions with re-sending "
                         "the history itself")
    turns = make_turns(options)
    report = new_report(runner, {
        "name": NAME, "sessions": options.sessions, "turns": options.turns,
        "turn_input_len": options.turn_input_len, "turn_output_len": options.turn_output_len,
        "seed": options.seed, "conversation_len": options.conversation_len,
        "background_prompts": options.background_prompts,
        "background_len": options.background_len,
        "output_tokens": options.sessions * options.turns * options.turn_output_len,
    })
    warmup = [TOKEN_ID_MAX - i for i in range(16)]
    with contextlib.ExitStack() as stack:
        convs = []
        for label, config in engine_configs(runner.config, options).items():
            engine = stack.enter_context(runner.engine(label, config, warmup=warmup))
            vocab = int(engine.arch.vocab_size)
            # A session's first turn locks the cached prefix it matches (the runner's warm-up
            # prompt), which the checker takes for a leak at idle: start from an empty cache.
            engine.kv.cache.reset()
            with runner.status(f"{label}: warm-up turns"):
                warm = [[[(TOKEN_ID_MAX - 7 * s - t) % vocab] * 4 for t in range(2)]
                        for s in range(options.sessions)]
                Conversations(engine, label, warm, 4).run_all()
            engine.kv.cache.reset()  # idle, no session open: start from an empty cache
            folded = [[[t % vocab for t in turn] for turn in conv] for conv in turns]
            background = [[[t % vocab for t in p] for p in make_background(options, t)]
                          for t in range(options.turns)]
            convs.append(Conversations(engine, label, folded, options.turn_output_len,
                                       background))
        # Both engines are up; their rounds alternate (and which goes first), so a machine
        # busy with other work slows both alike.
        for t in range(options.turns):
            for conv in convs[:: 1 if t % 2 == 0 else -1]:
                with runner.status(f"{conv.label}: turn {t + 1}/{options.turns}"):
                    conv.round(t)
        measured = {conv.label: conv.finish() for conv in convs}
    for label, (result, per_turn) in measured.items():
        report["runs"].append(run_entry(label, result, per_turn))
    report["summary"] = summarize(report["runs"], options)
    report["summary"]["same_outputs"] = (measured["sessions"][0].outputs
                                         == measured["resend"][0].outputs)
    return report


class Conversations:
    """Every conversation of one engine, one round (a turn of each, batched) at a time:
    with sessions, a turn sends its new tokens; without, the whole history and them."""

    def __init__(self, engine: Engine, label: str, turns: list[list[list[int]]],
                 output_len: int, background: list[list[list[int]]] | None = None) -> None:
        from plugserve.sampling import SamplingParams

        self.engine, self.label, self.turns = engine, label, turns
        self.background = background or [[] for _ in turns[0]]  # [turn][prompt]
        self.use_sessions = label == "sessions"
        self.sampling = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
        n = len(turns)
        self.sids: list[str | None] = ([engine.open_session() for _ in range(n)]
                                       if self.use_sessions else [None] * n)
        self.history: list[list[int]] = [[] for _ in range(n)]
        self.per_turn: dict[str, list[float]] = {k: [] for k in (
            "latency_s", "ttft_s", "cpu_s", "prompt_tokens", "prefill_tokens_computed",
            "cached_tokens")}
        self.reqs: list[Req] = []
        self.seconds = 0.0
        self.before = engine.stats()

    def round(self, t: int) -> None:
        engine, n, per_turn = self.engine, len(self.turns), self.per_turn
        where = f"{self.label} turn {t + 1}/{len(self.turns[0])}"
        computed = engine.stats().get("prefill_tokens", 0)
        prompts = [conv[t] if self.use_sessions else self.history[s] + conv[t]
                   for s, conv in enumerate(self.turns)]
        start, cpu = time.perf_counter(), time.process_time()
        reqs = run_round(engine, where, prompts, self.sids, self.sampling)
        per_turn["cpu_s"].append(time.process_time() - cpu)
        self.seconds += time.perf_counter() - start
        per_turn["prefill_tokens_computed"].append(
            (engine.stats()["prefill_tokens"] - computed) / n)
        per_turn["latency_s"].append(_mean([r.finished_s - r.created_s for r in reqs
                                            if r.finished_s is not None]))
        per_turn["ttft_s"].append(_mean([r.first_token_s - r.created_s for r in reqs
                                         if r.first_token_s is not None]))
        per_turn["prompt_tokens"].append(_mean([len(r.origin_input_ids) for r in reqs]))
        per_turn["cached_tokens"].append(_mean([r.cached_tokens for r in reqs]))
        self.history = [list(r.all_ids) for r in reqs]
        self.reqs += reqs
        if self.background[t]:  # other users, while these read the replies (not timed)
            others = self.background[t]
            run_round(engine, f"{where} background", others, [None] * len(others),
                      dataclasses.replace(self.sampling, max_new_tokens=1))

    def run_all(self) -> None:
        for t in range(len(self.turns[0])):
            self.round(t)
        self.finish()

    def finish(self) -> tuple[Measured, dict[str, list[float]]]:
        """Close the sessions; the run's figures (engine counters over its rounds)."""
        engine, before = self.engine, self.before
        after = engine.stats()
        for sid in self.sids:
            if sid is not None:
                engine.close_session(sid)
        counters = {k: int(after.get(k, 0)) - int(before.get(k, 0))
                    for k in engine.scheduler.stats}
        step_before = before.get("step_time_s", {})
        step_time = {k: float(v) - float(step_before.get(k, 0.0))
                     for k, v in after.get("step_time_s", {}).items()}
        return Measured(self.label, self.reqs, self.seconds, counters, step_time), self.per_turn


def run_round(engine: Engine, where: str, prompts: list[list[int]], sids: list[str | None],
              sampling: SamplingParams) -> list[Req]:
    reqs = []
    for i, (prompt, sid) in enumerate(zip(prompts, sids, strict=True)):
        req = engine.submit(prompt, sampling, session_id=sid)
        if req.error is not None:
            raise RequestRejectedError(where, i, len(req.origin_input_ids),
                                       sampling.max_new_tokens, req.error)
        reqs.append(req)
    engine.scheduler.run_until_idle()
    check_complete(where, reqs, [sampling.max_new_tokens] * len(reqs))
    return reqs


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_entry(label: str, measured: Measured, per_turn: dict[str, list[float]]) -> dict[str, Any]:
    latency, cpu = per_turn["latency_s"], per_turn["cpu_s"]
    head, tail = mean(latency[:HEAD_TURNS]), mean(latency[-HEAD_TURNS:])
    cpu_head, cpu_tail = mean(cpu[:HEAD_TURNS]), mean(cpu[-HEAD_TURNS:])
    later = per_turn["prefill_tokens_computed"][1:]
    return {
        **measured.metrics(),
        "settings": {"cache": RUNS[label], "sessions": label == "sessions"},
        "per_turn": per_turn,
        "head_latency_s": head,
        "tail_latency_s": tail,
        "tail_over_head": tail / head if head and tail is not None else None,
        # The process's CPU time per round: what other work on the machine changes least.
        "cpu_tail_over_head": cpu_tail / cpu_head if cpu_head and cpu_tail is not None else None,
        "computed_per_later_turn": mean(later),
    }


def summarize(runs: list[dict[str, Any]], options: SessionsOptions) -> dict[str, Any]:
    by = {r["name"]: r for r in runs}
    with_s, resend = by["sessions"], by["resend"]
    new = options.turn_input_len
    computed = with_s["per_turn"]["prefill_tokens_computed"]
    ratio = with_s["tail_over_head"]
    tails = (with_s["tail_latency_s"], resend["tail_latency_s"])
    late = min(HEAD_TURNS, options.turns)
    late_ttft = {r["name"]: mean(r["per_turn"]["ttft_s"][-late:]) for r in runs}
    ttft_ratio = (late_ttft["sessions"] / late_ttft["resend"]
                  if late_ttft["resend"] else None)
    return {
        "late_ttft_s": late_ttft,
        "late_ttft_sessions_over_resend": ttft_ratio,
        "head_turns": min(HEAD_TURNS, options.turns),
        "tail_over_head": {r["name"]: r["tail_over_head"] for r in runs},
        "cpu_tail_over_head": {r["name"]: r["cpu_tail_over_head"] for r in runs},
        "tail_latency_s": {r["name"]: r["tail_latency_s"] for r in runs},
        "computed_per_later_turn": {r["name"]: r["computed_per_later_turn"] for r in runs},
        "resend_tail_over_sessions_tail": tails[1] / tails[0] if tails[0] else None,
        "targets": {
            "tail_over_head_le_1.1": ratio is not None and ratio <= RATIO_TARGET,
            "computed_eq_new_tokens_plus_1": computed[0] == new
            and all(new <= c <= new + 1 for c in computed[1:]),
            "tail_lower_than_resend": tails[0] < tails[1],
            "late_ttft_le_half_resend": ttft_ratio is not None and ttft_ratio <= TTFT_TARGET,
        },
    }


def print_tables(report: dict[str, Any], console: Any = None) -> None:
    """The per-turn table (first and last HEAD_TURNS turns) and the summary lines."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    runs = report["runs"]
    table = Table("turn", *(f"{r['name']}\n{col}" for r in runs
                            for col in ("latency ms", "TTFT ms", "round CPU s", "computed")),
                  "prompt tok", title="per turn (mean over sessions; computed = prefill tokens)")
    turns = report["workload"]["turns"]
    shown = sorted(set(range(min(HEAD_TURNS, turns))) | set(range(max(0, turns - HEAD_TURNS),
                                                                   turns)))
    for i, t in enumerate(shown):
        if i and t != shown[i - 1] + 1:
            table.add_row("...")
        cells = []
        for r in runs:
            p = r["per_turn"]
            cells += [f"{p['latency_s'][t] * 1000:,.1f}", f"{p['ttft_s'][t] * 1000:,.1f}",
                      f"{p['cpu_s'][t]:,.2f}", f"{p['prefill_tokens_computed'][t]:g}"]
        table.add_row(str(t + 1), *cells, f"{runs[0]['per_turn']['prompt_tokens'][t]:g}")
    console.print(table)
    s = report["summary"]
    flag = {True: "yes", False: "NO"}
    for r in runs:
        console.print(f"{r['name']}: head {r['head_latency_s'] * 1000:,.1f} ms, tail "
                      f"{r['tail_latency_s'] * 1000:,.1f} ms (first / last {s['head_turns']} "
                      f"turns), tail / head {r['tail_over_head']:.2f} (CPU time "
                      f"{r['cpu_tail_over_head']:.2f}), computed per later turn "
                      f"{r['computed_per_later_turn']:.1f}", highlight=False)
    t = s["targets"]
    console.print(
        f"targets: sessions tail / head <= {RATIO_TARGET:.2f}: "
        f"{flag[t['tail_over_head_le_1.1']]}; computed = new tokens (+1): "
        f"{flag[t['computed_eq_new_tokens_plus_1']]}; tail below resend: "
        f"{flag[t['tail_lower_than_resend']]} "
        f"(resend / sessions {s['resend_tail_over_sessions_tail'] or 0:.2f}x); same tokens "
        f"with and without sessions: {flag[bool(s.get('same_outputs'))]}", highlight=False)
    ttft = s["late_ttft_s"]
    console.print(
        f"late-turn TTFT (last {s['head_turns']} turns): sessions "
        f"{ttft['sessions'] * 1000:,.1f} ms, resend {ttft['resend'] * 1000:,.1f} ms = "
        f"{s['late_ttft_sessions_over_resend'] or 0:.2f}x (target <= {TTFT_TARGET:.1f}x: "
        f"{flag[t['late_ttft_le_half_resend']]})", highlight=False)
