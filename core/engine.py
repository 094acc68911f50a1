"""Engine facade: start-up (plugins, model, pools, scheduler), generate, stream, abort."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from plugserve.admission import AdmissionLimits, prompt_ids, request_problems
from plugserve.config import EngineConfig
from plugserve.device import device_problems
from plugserve.fixes import unknown_reverts
from plugserve.grammar.selection import grammar_problem, grammar_service
from plugserve.mem.accounting import PoolTerms
from plugserve.mem.build import KVSizeError, build_kv_memory
from plugserve.mem.idle_check import idle_memory_problems
from plugserve.mem.session_kv import SessionKV
from plugserve.mem.sessions import SessionError
from plugserve.model.weight_bytes import pack_bytes, weight_bytes
from plugserve.model.weight_pages import place_on_huge_pages
from plugserve.outputs import GenerateResult, StreamEvent, group_result
from plugserve.parallel.cross_check import TP_RANK1_SKIPS_FREE, skip_one_free
from plugserve.parallel.leader import LeaderScheduler
from plugserve.parallel.runner import TPModelRunner
from plugserve.parallel.runtime import RankMemory, TensorParallel
from plugserve.plugins import PluginHost, load_plugins
from plugserve.request_input import PromptError
from plugserve.runner.grammar_step import GrammarMask
from plugserve.runner.model_runner import ModelRunner
from plugserve.sampling import SamplingParams
from plugserve.sched.samples import add_samples, run_sampling, samples_problems
from plugserve.sched.scheduler import Scheduler
from plugserve.spec.base import SpecAlgorithm, SpecContext
from plugserve.startup import (
    attention_context,
    lifecycle_plugins,
    prepare_cpu,
    usable_context_len,
    with_model_cache,
)
from plugserve.stream_events import StreamTracker
from plugserve.structs.req import Req
from plugserve.structs.spec_footprint import SpecFootprint
from plugserve.structured import GrammarSpec
from plugserve.validation import validate_config

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineStartError(RuntimeError):
    """The engine cannot start; the message lists every reason."""


class EngineStoppedError(RuntimeError):
    """An earlier step failed (e.g. a KV leak was found): the engine no longer serves."""


def _torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _refuse(reasons: list[str]) -> None:
    if reasons:
        raise EngineStartError(
            "unsupported configuration:\n" + "\n".join(f"  - {r}" for r in reasons)
        )


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        plugins: Sequence[str] = (),
        **overrides: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = config.model_copy(update=overrides)
        self.config = config
        self._plugins = tuple(plugins)
        self.host: PluginHost = load_plugins(plugins, allowlist=config.plugins)
        reasons = validate_config(config, self.host.registries)
        reasons += unknown_reverts(config.revert_fixes, self.host.fix_toggles)
        reasons += device_problems(config.device)
        _refuse(reasons)
        torch.manual_seed(config.seed)
        self.tp: TensorParallel | None = None
        try:
            self._build(config)
        except BaseException:
            if self.tp is not None:  # the other ranks must not wait for this one
                self.tp.close(abandon=True)
            raise

    @classmethod
    def run_follower(cls, config: EngineConfig, plugins: Sequence[str] = ()) -> None:
        """On a tensor-parallel rank > 0 (torchrun's RANK): build this rank's engine and
        follow rank 0 until it closes (`plugserve.parallel.follower`)."""
        from plugserve.parallel.follower import run_follower_rank

        run_follower_rank(cls, config, plugins)

    # --- start-up ---------------------------------------------------------------------------
    def _build(self, cfg: EngineConfig) -> None:
        from plugserve.model import load_model

        self.device = torch.device(cfg.device)
        self.dtype = _torch_dtype(cfg.dtype)
        if cfg.tp_size > 1:  # every start-up check between the ranks, before any weight
            from plugserve.model.tp_loader import model_arch

            self.tp = TensorParallel.start(cfg, model_arch(cfg.model), self._plugins, type(self))
            self.device = self.tp.device
        if self.device.type == "cpu":
            prepare_cpu()
        if self.tp is not None:
            self.tp.share_memory_for_all_reduce()
        loaded = load_model(cfg.model, dtype=self.dtype, device=self.device,
                            shard=self.tp.shard if self.tp is not None else None,
                            quantization=cfg.quantization,
                            quant_activations=cfg.quant_activations)
        self.model = loaded.model
        # The weights on huge pages in one arena (CPU), before any kernel caches one.
        self.weight_placement = (place_on_huge_pages(self.model)
                                 if self.device.type == "cpu" else None)
        self.weight_bytes = weight_bytes(self.model)
        self.arch = loaded.arch
        rank_arch = loaded.rank_arch  # this rank's heads (all of them without TP)
        self.tokenizer = loaded.tokenizer
        arch = self.arch
        registries = self.host.registries
        # Refused with the backend's own reasons, below.
        cfg, model_reasons = with_model_cache(cfg, arch, registries)
        self.config = cfg
        spec_cls = registries.spec.get(cfg.spec).load() if cfg.spec != "none" else None
        footprint: SpecFootprint | None = spec_cls.plan_footprint(cfg) if spec_cls else None
        self.spec_footprint = footprint
        self.context_len = usable_context_len(cfg, arch, footprint)
        attention = registries.attention.get(cfg.attention)
        backend_cls = attention.load()
        attention_ctx = attention_context(cfg, arch, rank_arch, self.context_len, self.dtype,
                                          self.device)
        self.checkers, self.hook_pm = lifecycle_plugins(self.host, cfg, self.tp)
        try:
            # What the backend refuses for this model, before any KV memory is allocated.
            _refuse(model_reasons + backend_cls.validate(attention_ctx))
            memory = build_kv_memory(
                cfg, rank_arch, dtype=self.dtype, device=self.device,
                context_len=self.context_len, attention_caps=attention.capabilities,
                cache_entry=registries.cache.get(cfg.cache), footprint=footprint,
                weight_bytes=self.weight_bytes,
            )
        except KVSizeError as exc:
            _refuse(exc.reasons)
            raise
        self.kv, self.kv_pool = memory.kv, memory.kv_pool
        log.info("model %s: %.1f MiB of weights; KV pool of %d slots",
                 cfg.model or "(default)", self.weight_bytes / (1 << 20),
                 memory.kv.allocator.total_slots)
        self.swa_layer_ids = memory.swa_layer_ids
        num_pages, rows = memory.num_pages, memory.kv.rows
        self.backend = backend_cls(attention_ctx)
        runner_args = (self.model, self.backend, self.kv_pool, rows, self.context_len,
                       self.device, self.tokenizer.eos_token_ids)
        self.runner = (ModelRunner(*runner_args) if self.tp is None
                       else TPModelRunner(*runner_args, shard=self.tp.shard))
        self.runner.writes_future_tokens = cfg.overlap
        self.grammar = grammar_service(registries.grammar, cfg.grammar_backend, arch.vocab_size,
                                       self.tokenizer)
        if self.grammar is not None:
            self.runner.sampler.steps.append(GrammarMask(self.grammar, self.runner.time_s))
        self.spec: SpecAlgorithm | None = None
        if spec_cls is not None:
            self.spec = spec_cls(
                SpecContext(
                    config=cfg, target=self.model, arch=arch, backend=self.backend,
                    target_kv_pool=self.kv_pool, req_to_token_pool=rows,
                    num_pages=num_pages, dtype=self.dtype, device=self.device,
                    time_s=self.runner.time_s, grammar=self.grammar,
                )
            )
            self.runner.spec = self.spec
        sched_args = (cfg, self.runner, self.kv, self.hook_pm.hook, self.tokenizer.eos_token_ids,
                      self.tokenizer.decode)
        self.scheduler = (
            LeaderScheduler(*sched_args, spec=self.spec, tp=self.tp)
            if self.tp is not None and self.tp.leads else Scheduler(*sched_args, spec=self.spec)
        )
        if self.tp is not None and TP_RANK1_SKIPS_FREE in cfg.revert_fixes and self.tp.rank == 1:
            skip_one_free(self.kv.allocator)
        if self.tp is not None:
            self.tp.wait_for_all_built(
                RankMemory.of(self.model, self.kv_pool, self.kv.allocator.total_slots))
        self._admission = AdmissionLimits(
            vocab_size=arch.vocab_size, context_len=self.context_len,
            pool_slots=self.kv.allocator.total_slots, page_size=cfg.page_size,
            spec_name=cfg.spec if self.spec is not None else None,
            spec_reserve_len=footprint.reserve_len if footprint is not None else 0,
            spec_checks_grammar=self.spec is not None and bool(
                getattr(registries.spec.get(cfg.spec).capabilities, "grammar", False)),
        )
        self.hook_pm.hook.plugserve_engine_configured(config=cfg, scheduler=self.scheduler)
        self._rids = itertools.count()
        self._closed = False
        self._failed: BaseException | None = None

    def compile_grammar(self, spec: GrammarSpec) -> Any:
        """A Future of `spec`'s compiled grammar (cached), raising `GrammarError` when it is
        invalid: a server awaits it to refuse a bad schema before queueing the request."""
        problem = self._grammar_problem(spec)
        if problem is not None:
            from plugserve.grammar.base import GrammarError

            raise GrammarError(problem)
        assert self.grammar is not None
        return self.grammar.compile(spec)

    def _grammar_problem(self, spec: GrammarSpec) -> str | None:
        return grammar_problem(self.grammar, self.config.grammar_backend,
                               self.host.registries.grammar, spec)

    # --- requests ---------------------------------------------------------------------------
    def submit(
        self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
        chat: bool = False, session_id: str | None = None, session_offset: int | None = None,
        streaming: bool = False,
    ) -> Req:
        """Queue one request. A bad request (malformed prompt, invalid sampling parameters)
        never raises: it comes back finished with reason "error" and `error` set, unqueued.
        Raises only when the engine itself cannot serve (closed, or stopped by an error).
        With `sampling.n` (or `best_of`) > 1 the returned request is sample 0 and
        `req.group` holds every sample (plugserve.sched.samples); `streaming` refuses
        best_of > n, whose choice is known only once all finished."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._failed is not None:
            raise EngineStoppedError(
                f"the engine stopped serving after an earlier error: {self._failed}"
            )
        sp = SamplingParams() if sampling is None else sampling
        rid = next(self._rids)
        ids: list[int] = []
        if not isinstance(sp, SamplingParams):
            problems = [f"sampling must be a SamplingParams, got {type(sp).__name__}"]
        else:
            try:
                ids = prompt_ids(self.tokenizer, prompt, chat)
            except PromptError as exc:
                problems = [str(exc)]
            except Exception as exc:
                problems = [f"could not tokenize the prompt: {exc}"]
            else:
                try:
                    if session_id is not None:
                        ids = self._session(session_id).turn_ids(session_id, ids, session_offset)
                    problems = request_problems(ids, sp, self._admission, self._grammar_problem)
                    problems += samples_problems(sp, session_id, streaming)
                except SessionError as exc:
                    problems = [str(exc)]
                except Exception as exc:  # a check that itself failed: reject, never raise
                    problems = [f"invalid request: {type(exc).__name__}: {exc}"]
        if problems:
            # Built from default parameters: Req() must not touch the invalid values (a
            # float seed would raise there); the result still shows the ones given.
            req = Req(rid, ids, SamplingParams())
            if isinstance(sp, SamplingParams):
                req.sampling = sp
            req.finished_reason = "error"
            req.error = "; ".join(problems)
            req.finish_released = True
        else:
            req = Req(rid, ids, run_sampling(sp), session_id=session_id)
            req.logprobs_asked = sp.logprobs
            if sp.structured_outputs is not None and self.grammar is not None:
                req.grammar_future = self.grammar.compile(sp.structured_outputs)
            if session_id is not None:
                self._session(session_id).begin_turn(req, session_offset)
            self.scheduler.add_request(req)
            self._record(("submit", rid, ids, req.sampling, session_id, session_offset))
            # n > 1: samples 1.. take the next ids (the other ranks number them the same).
            for child in add_samples(req, lambda: next(self._rids), self.kv.forks.enabled):
                self.scheduler.add_request(child)
        return req

    # --- streaming sessions -----------------------------------------------------------------
    def open_session(self, timeout_s: float = 600.0) -> str:
        """Open a streaming session: its KV stays between turns (`generate(...,
        session_id=)`); closed by `close_session` or after `timeout_s` idle seconds."""
        session_id = self._session(None).store.open(timeout_s).session_id
        self._record(("open_session", timeout_s, session_id))
        return session_id

    def close_session(self, session_id: str) -> None:
        """Free everything the session holds (no turn may be in progress)."""
        self._session(session_id).close(session_id)
        self._record(("close_session", session_id))

    def _session(self, session_id: str | None) -> SessionKV:
        sessions = self.kv.sessions
        if sessions is None:
            raise SessionError(
                f"sessions need a cache policy that supports them; cache={self.config.cache!r} "
                "does not: use cache='streaming_session' (--cache streaming_session)"
            )
        for closed in sessions.reap():  # timed out (rank 0's clock decides for every rank)
            self._record(("close_session", closed))
        return sessions

    def _record(self, command: tuple[Any, ...]) -> None:
        """Tensor parallelism: the other ranks make this change to their scheduler's work
        before the next step (`plugserve.parallel.leader`)."""
        if self.tp is not None:
            self.tp.record(command)

    def rank_problem(self) -> str | None:
        """Why another tensor-parallel rank cannot serve (it died or failed), or None."""
        return self.tp.problem() if self.tp is not None else None

    def abort(self, req: Req) -> bool:
        """End one request (one sample of an n > 1 request: the others go on)."""
        return self.scheduler.abort(req.rid)

    def abort_samples(self, req: Req) -> bool:
        """End every sample of `req`'s group (`req` is the group's first sample)."""
        return any([self.scheduler.abort(r.rid) for r in req.group])

    def generate(
        self,
        prompts: Sequence[str | list[int]] | str,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        session_id: str | None = None,
        session_offset: int | None = None,
    ) -> list[GenerateResult]:
        """Run the prompts to the end. With `session_id`, a prompt is one turn of that
        streaming session: only its new tokens, appended to the conversation (after the first
        `session_offset` tokens of it, when given)."""
        reqs = self._submit_all(prompts, sampling, chat, session_id, session_offset)
        with self._stop_on_error():
            self.scheduler.run_until_idle()
        return [group_result(i, r, self.tokenizer.decode, r.logprobs_asked)
                for i, r in enumerate(reqs)]

    def stream(
        self,
        prompts: Sequence[str | list[int]] | str,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        session_id: str | None = None,
        session_offset: int | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield new tokens per request as steps produce them. Every request of the call gets
        exactly one final event (finished=True, `result` set), however it ended: finished,
        aborted while waiting or while running, or rejected at submit. Sessions as in
        `generate`."""
        parents = self._submit_all(prompts, sampling, chat, session_id, session_offset,
                                   streaming=True)
        events = StreamTracker(parents, self.tokenizer.decode)
        sched = self.scheduler
        while True:
            with self._stop_on_error():
                progressed = sched.step()
            yield from events.after_step()
            if not progressed and sched.is_idle():
                with self._stop_on_error():
                    sched.settle_idle()
                break
        yield from events.finish_all()

    def _submit_all(
        self,
        prompts: Sequence[str | list[int]] | str,
        sampling: SamplingParams | Sequence[SamplingParams] | None,
        chat: bool,
        session_id: str | None = None,
        session_offset: int | None = None,
        streaming: bool = False,
    ) -> list[Req]:
        """Queue one call's requests (each with its samples when n > 1). A bad request comes
        back from submit finished with an error; should submit raise anyway (engine closed or
        stopped), nothing of this call stays queued."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = self._per_prompt(sampling, len(prompts))
        reqs: list[Req] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                reqs.append(self.submit(p, sp, chat=chat, session_id=session_id,
                                        session_offset=session_offset, streaming=streaming))
        except BaseException:
            for r in reqs:
                self.abort_samples(r)
            raise
        return reqs

    @contextlib.contextmanager
    def _stop_on_error(self) -> Iterator[None]:
        """Any error inside a step (a leak found by a checker, a model error) leaves memory in
        an unknown state: stop serving rather than corrupt it."""
        try:
            yield
        except BaseException as exc:
            self._failed = exc
            raise

    @staticmethod
    def _per_prompt(
        sampling: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling is None:
            return [SamplingParams()] * n
        if isinstance(sampling, SamplingParams):
            return [sampling] * n
        if not isinstance(sampling, Sequence):
            raise TypeError("sampling must be a SamplingParams, a sequence of them (one per "
                            f"prompt) or None, got {type(sampling).__name__}")
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} sampling params for {n} prompts")
        return list(sampling)

    # --- introspection ----------------------------------------------------------------------
    def pack_bytes(self) -> int:
        """Bytes the CPU kernels hold now in layouts of their own for the weights, beside
        `weight_bytes` (made on first use, or all at a server's start)."""
        return pack_bytes(self.model)

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        out: dict[str, Any] = dict(sched.stats)
        out["step_time_s"] = {**dict(sched.step_time_s), **dict(self.runner.time_s)}
        full = self.kv.full
        out["kv_available_slots"] = full.allocator.available_size()
        out["kv_total_slots"] = full.total
        out["cache_evictable_slots"] = full.evictable_size()
        out["cache_protected_slots"] = full.protected_size()
        out["kv_pools"] = {t.pool: vars(t) for t in self.scheduler.kv_terms()}
        out["weight_bytes"] = self.weight_bytes
        out["weight_pack_bytes"] = self.pack_bytes()
        if self.tp is not None:
            out["tensor_parallel"] = self.tp.stats()
        for checker in self.checkers:
            if hasattr(checker, "counters"):
                out.setdefault("checker", {}).update(checker.counters())
        return out

    # --- driving the engine step by step (a server's loop) ---------------------------------
    # `generate` and `stream` run the scheduler themselves. A loop that serves requests as they
    # come (plugserve.server) uses these instead: `submit` / `abort`, then `step()` until
    # `is_idle()`, reading each `Req`'s tokens between steps. One thread at a time.

    def step(self) -> bool:
        """One scheduler step. True when it did work (a forward ran, or a forward's results
        were processed); False when there was nothing to do. A step that finds nothing left
        (nothing waits, runs or is in flight) settles the engine: the idle hooks run (the
        checker's idle check) and `is_idle()` is True until the next submit. An error inside
        a step stops the engine (later submits raise EngineStoppedError) and is raised."""
        sched = self.scheduler
        with self._stop_on_error():
            progressed = sched.step()
            if not progressed and sched.is_idle():
                sched.settle_idle()
        return progressed

    def is_idle(self) -> bool:
        """Nothing waits, runs or is in flight."""
        return bool(self.scheduler.is_idle())

    def num_waiting(self) -> int:
        """Requests submitted and not admitted yet."""
        return len(self.scheduler.waiting)

    def kv_terms(self) -> tuple[PoolTerms, ...]:
        """Each KV pool's conservation terms now (available, evictable, protected,
        session_held, uncached, total and their balance): what a metrics endpoint exports."""
        return self.scheduler.kv_terms()

    def memory_problems(self) -> list[str]:
        """At idle: every reason the memory is not whole (empty = whole); the rules are
        `plugserve.mem.idle_check`'s. A real check (not `assert`): it holds under `python -O`
        too."""
        return idle_memory_problems(self.kv)

    def close(self) -> None:
        if not self._closed:
            self.scheduler.close()
            if self.grammar is not None:
                self.grammar.close()
            if self.tp is not None:
                self.tp.close()
            self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
