"""Drive engines through a benchmark: start-up and warm-up, timed runs, a progress bar.

A timed run submits requests with `engine.submit` (all at once, or keeping at most
`concurrency` in flight), steps the scheduler itself and advances the progress bar by one per
finished request. The engine's counters and phase times are read before and after, so a
run reports only its own work (not the warm-up's).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plugserve.bench import metrics

if TYPE_CHECKING:
    from rich.progress import Progress

    from plugserve.bench.line_progress import LineProgress
    from plugserve.config import EngineConfig
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams
    from plugserve.structs.req import Req

Prompt = str | list[int]
WARMUP_TOKENS = 8
WARMUP_PROMPT_LEN = 16
WARMUP_BATCH = 16  # requests of the batched warm-up: more rows than the few-row kernels take


class BenchError(RuntimeError):
    """A run whose numbers would not be comparable (a rejected or short request)."""


class BenchOptionsError(ValueError):
    """Options a workload cannot run with (a user error: the message says what to change)."""


class RequestRejectedError(BenchError):
    """The engine refused one of the workload's requests (`req.error`, e.g. a prompt longer
    than the context): the workload does not fit this engine. A user error: the message names
    the run, the request and the engine's reason."""

    def __init__(self, label: str, index: int, prompt_tokens: int, max_new_tokens: int,
                 reason: str) -> None:
        self.label = label
        self.index = index
        self.reason = reason
        where = f"bench run {label!r}: " if label else ""
        super().__init__(
            f"{where}request {index} ({prompt_tokens} prompt tokens, max_new_tokens="
            f"{max_new_tokens}) was rejected by the engine: {reason}"
        )


@dataclass
class Measured:
    """One timed run: the finished requests and the engine's work during it."""

    label: str
    reqs: list[Req]
    seconds: float
    counters: dict[str, int]  # engine counter deltas (steps, prefill_tokens, ...)
    step_time_s: dict[str, float]  # phase-time deltas
    iteration: int = 0  # a further timing of the same run on new prompts (bench prefill)

    def metrics(self, spec: bool | None = None) -> dict[str, Any]:
        """Throughput, latency and step-time figures of this run (JSON-ready), and the
        speculation figures when `spec` (None: when any verify round ran)."""
        out = {
            "name": self.label,
            **metrics.throughput_metrics(self.reqs, self.seconds),
            **metrics.latency_metrics(self.reqs),
            "step_time": metrics.step_breakdown(self.step_time_s),
            "engine_counters": dict(self.counters),
        }
        if spec or (spec is None and any(r.spec_verify_steps for r in self.reqs)):
            out.update(metrics.spec_metrics(self.reqs))
        return out

    @property
    def prompts(self) -> list[list[int]]:
        return [list(r.origin_input_ids) for r in self.reqs]

    @property
    def outputs(self) -> list[list[int]]:
        return [list(r.output_ids) for r in self.reqs]


@dataclass
class Runner:
    """Starts engines for one benchmark and runs timed request sets on them."""

    config: EngineConfig
    plugins: tuple[str, ...] = ()
    console: Any = None
    show_progress: bool = True
    # Every timed run so far, in order (`--compare vllm` replays the first one's requests).
    measured: list[Measured] = field(default_factory=list, init=False, repr=False)
    _progress: Progress | LineProgress | None = field(default=None, init=False, repr=False)

    @contextmanager
    def session(self) -> Iterator[Runner]:
        """Show the progress bar while the bench runs: rich's on a terminal (unless turned off),
        plain lines with a heartbeat elsewhere (`plugserve.bench.line_progress`)."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        from plugserve.bench.line_progress import LineProgress

        if self.console is not None and not self.console.is_terminal:
            with LineProgress(self.console) as lines:
                self._progress = lines
                try:
                    yield self
                finally:
                    self._progress = None
            return
        enabled = self.show_progress and self.console is not None
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=not enabled,
        )
        with progress:
            self._progress = progress
            try:
                yield self
            finally:
                self._progress = None

    @contextmanager
    def status(self, description: str) -> Iterator[None]:
        """An indeterminate progress line while something without a count runs."""
        progress = self._progress
        task = progress.add_task(description, total=None) if progress is not None else None
        try:
            yield
        finally:
            if progress is not None and task is not None:
                progress.remove_task(task)

    @contextmanager
    def engine(
        self, label: str, config: EngineConfig | None = None, warmup: Prompt | None = None
    ) -> Iterator[Engine]:
        """Start an engine (this runner's config unless one is given), warm it up, close it."""
        from plugserve.engine import Engine

        with self.status(f"{label}: loading model"):
            engine = Engine(config or self.config, plugins=self.plugins)
        try:
            with self.status(f"{label}: warm-up"):
                warm_up(engine, warmup)
            yield engine
        finally:
            engine.close()

    def measure(
        self,
        engine: Engine,
        label: str,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        *,
        chat: bool = False,
        concurrency: int | None = None,
        cold_cache: bool = True,
        iteration: int = 0,
    ) -> Measured:
        """Run the requests to completion and time them; each must give all its tokens.
        `iteration` > 0 marks a further timing of run `label` (on new prompts)."""
        if cold_cache:
            engine.kv.cache.reset()  # start from an empty prefix cache (the engine is idle)
        before = engine.stats()
        progress = self._progress
        task = progress.add_task(label, total=len(prompts)) if progress is not None else None

        def advance() -> None:
            if progress is not None and task is not None:
                progress.advance(task)

        start = time.perf_counter()
        reqs = drive(engine, prompts, params, chat=chat, concurrency=concurrency, on_done=advance,
                     label=label)
        seconds = time.perf_counter() - start
        after = engine.stats()
        if progress is not None and task is not None:
            progress.remove_task(task)
        check_complete(label, reqs, [p.max_new_tokens for p in params])
        counters = {
            k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in engine.scheduler.stats
        }
        step_before = before.get("step_time_s", {})
        step_time = {
            k: float(v) - float(step_before.get(k, 0.0))
            for k, v in after.get("step_time_s", {}).items()
        }
        result = Measured(label, reqs, seconds, counters, step_time, iteration)
        self.measured.append(result)
        return result


def warm_up(engine: Engine, prompt: Prompt | None) -> None:
    """The workload's first prompt at its full length, then WARMUP_BATCH short requests of
    different lengths batched, so the timed runs pay no first-call costs: the single-request,
    few-row and batched paths are taken, every weight is packed for the linears that run
    them (the float32 panel GEMM from 9 rows, `plugserve.kernels.panel_gemm`, the output head
    included), and the GEMM library has built its kernels for the prompt's shapes (oneDNN
    builds them per shape on first use: a 1,024-token bf16 prefill took 0.38 s the first time
    and 0.23 s after, 2 Xeon cores). The timed runs start from an empty prefix cache
    (`measure`), so nothing of the warm-up is reused."""
    from plugserve.sampling import SamplingParams

    if prompt is None:
        prompt = list(range(1, WARMUP_PROMPT_LEN + 1))
    short = prompt
    if isinstance(prompt, list):
        prompt = [t % int(engine.arch.vocab_size) for t in prompt]
        short = prompt[:WARMUP_PROMPT_LEN]
    sampling = SamplingParams(max_new_tokens=WARMUP_TOKENS, ignore_eos=True)
    engine.generate([prompt], sampling)
    batch = [short[: max(1, len(short) * (i + 1) // WARMUP_BATCH)] for i in range(WARMUP_BATCH)]
    engine.generate(batch, sampling)


def drive(
    engine: Engine,
    prompts: Sequence[Prompt],
    params: Sequence[SamplingParams],
    *,
    chat: bool = False,
    concurrency: int | None = None,
    on_done: Callable[[], None] | None = None,
    label: str = "",
) -> list[Req]:
    """Submit the requests (keeping at most `concurrency` unfinished) and step the scheduler
    until every one is finished and the engine is idle; `on_done` runs per finished request.

    A request the engine rejects raises `RequestRejectedError` (naming the run `label`)."""
    if len(prompts) != len(params):
        raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    sched = engine.scheduler
    limit = concurrency or len(prompts)
    queue = deque(range(len(prompts)))
    reqs: list[Req | None] = [None] * len(prompts)
    live: list[Req] = []

    def top_up() -> None:
        while queue and len(live) < limit:
            i = queue.popleft()
            req = engine.submit(prompts[i], params[i], chat=chat)
            if req.error is not None:
                raise RequestRejectedError(label, i, len(req.origin_input_ids),
                                           params[i].max_new_tokens, req.error)
            reqs[i] = req
            live.append(req)

    top_up()
    while True:
        progressed = sched.step()
        for req in [r for r in live if r.finished() and r.finish_released]:
            live.remove(req)
            if on_done is not None:
                on_done()
        top_up()
        if not progressed and sched.is_idle() and not queue:
            sched.settle_idle()
            break
    for _ in live:  # finished at idle without a release event
        if on_done is not None:
            on_done()
    return [r for r in reqs if r is not None]


def check_complete(label: str, reqs: Sequence[Req], wanted: Sequence[int]) -> None:
    """EOS is ignored, so every request must produce exactly its output length (or end where
    its grammar is complete, under `--structured`)."""
    for i, (req, n) in enumerate(zip(reqs, wanted, strict=True)):
        grammar_done = req.grammar is not None and req.grammar.terminated_at == len(
            req.output_ids)
        if req.error or (len(req.output_ids) != n and not grammar_done):
            raise BenchError(
                f"{label}: request {i} produced {len(req.output_ids)} of {n} tokens "
                f"(finish reason {req.finished_reason!r}, error {req.error!r}); the figures "
                "would not be comparable"
            )


def derive(config: EngineConfig, **update: Any) -> EngineConfig:
    """`config` with some fields replaced, validated again (unlike `model_copy`)."""
    return type(config).model_validate({**config.model_dump(), **update})


def new_report(runner: Runner, workload: dict[str, Any]) -> dict[str, Any]:
    """The JSON document every workload fills: its parameters, the base config, its runs."""
    return {"workload": workload, "config": runner.config.model_dump(mode="json"), "runs": []}
