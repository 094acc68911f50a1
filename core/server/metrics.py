"""Prometheus metrics of one server, in its own CollectorRegistry (two servers in one process
never mix their numbers). `GET /metrics` renders them in the text format.

Generation requests by outcome (stop, length, abort, error: the engine's finish reasons;
rejected: a 4xx; overloaded: a 503; failed: a 500), prompt and generated tokens, TTFT / ITL /
end-to-end latency histograms (measured from the HTTP request's arrival), HTTP errors by
status and type, running and waiting requests, KV slots per pool by conservation term, and
the checker's state. Engine figures are written by the engine thread; prometheus_client's
metrics are thread-safe.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
TERMS = ("available", "evictable", "protected", "session_held", "uncached", "total")


class ServerMetrics:
    def __init__(self, model_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("plugserve_requests", "Generation requests by outcome",
                                ["outcome"], registry=r)
        self.http_errors = Counter("plugserve_http_errors", "Error responses by status and type",
                                   ["status", "type"], registry=r)
        self.prompt_tokens = Counter("plugserve_prompt_tokens", "Prompt tokens of served "
                                     "requests", registry=r)
        self.generation_tokens = Counter("plugserve_generation_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram("plugserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("plugserve_inter_token_latency_seconds", "Gap between a request's "
                             "successive tokens (0 within one speculative round)",
                             buckets=ITL_BUCKETS, registry=r)
        self.latency = Histogram("plugserve_request_latency_seconds", "Arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("plugserve_requests_running", "Requests admitted and not finished",
                             registry=r)
        self.waiting = Gauge("plugserve_requests_waiting", "Requests queued, not yet running",
                             registry=r)
        self.kv_slots = Gauge("plugserve_kv_slots", "KV slots per pool by conservation term",
                              ["pool", "term"], registry=r)
        self.kv_balance = Gauge("plugserve_kv_balance_slots", "Conservation balance per pool "
                                "(0 = every slot accounted for)", ["pool"], registry=r)
        self.memory_whole = Gauge("plugserve_memory_whole_at_idle", "1 when the last idle check "
                                  "found every KV slot and request row free or cached",
                                  registry=r)
        self.checker_level = Gauge("plugserve_checker_level", "Invariant checker level "
                                   "(0 = off)", registry=r)
        self.checker_steps = Gauge("plugserve_checker_steps_checked", "Busy steps the checker "
                                   "proved", registry=r)
        self.checker_idle = Gauge("plugserve_checker_idle_checks", "Idle checks the checker "
                                  "proved", registry=r)
        self.engine_stats = Gauge("plugserve_engine_stat", "Scheduler counters since start "
                                  "(steps, prefill_tokens, retracted_reqs)", ["stat"],
                                  registry=r)
        self.step_phase = Gauge("plugserve_engine_step_phase_seconds", "Wall seconds of the "
                                "engine's steps since start, by phase (the scheduler's: "
                                "schedule, run, wait, post_process, check; the model runner's "
                                "within run: prepare, metadata, forward, sample, ...)",
                                ["phase"], registry=r)
        self.engine_up = Gauge("plugserve_engine_up", "1 while the engine thread serves",
                               registry=r)
        self.loop_time = Gauge("plugserve_engine_loop_seconds", "Where the serving time goes "
                               "since the server started: engine_step and publish (wall), "
                               "engine_thread_cpu; http_loop_cpu (the event loop thread: "
                               "HTTP, JSON, SSE, tokenizing, detokenizing); process_cpu (this "
                               "process); engine_process_cpu (with --engine-process)",
                               ["part"], registry=r)
        self._cpu0 = _process_cpu()
        self._http_cpu0 = 0.0
        self.info = Gauge("plugserve_model_info", "The served model", ["model"], registry=r)
        self.weight_bytes = Gauge("plugserve_weight_bytes", "Resident bytes of the model's "
                                  "weights (quantized ones as their blocks)", registry=r)
        self.weight_pack_bytes = Gauge(
            "plugserve_weight_pack_bytes", "Bytes of the copies of the weights the CPU "
            "kernels lay out for themselves (GEMM library and batch-kernel packs), made at "
            "start", registry=r)
        self.info.labels(model=model_id).set(1)
        self.memory_whole.set(1)

    # --- written by the HTTP side ---------------------------------------------------------
    def http_error(self, status: int, type_: str, path: str = "") -> None:
        self.http_errors.labels(status=str(status), type=type_).inc()
        if path not in GENERATION_PATHS:
            return
        if status == 503:
            self.requests.labels(outcome="overloaded").inc()
        elif 400 <= status < 500:
            self.requests.labels(outcome="rejected").inc()
        elif status >= 500:
            self.requests.labels(outcome="failed").inc()

    # --- written by the engine thread -----------------------------------------------------
    def request_finished(self, handle: Any, req: Any) -> None:
        self.requests.labels(outcome=str(req.finished_reason)).inc()
        self.prompt_tokens.inc(len(req.origin_input_ids))
        self.generation_tokens.inc(len(req.output_ids))
        if req.first_token_s is not None:
            self.ttft.observe(max(0.0, req.first_token_s - handle.arrival_s))
        for a, b in pairwise(req.token_times_s):
            self.itl.observe(b - a)
        if req.finished_s is not None:
            self.latency.observe(max(0.0, req.finished_s - handle.arrival_s))

    def engine_state(
        self, *, running: int, waiting: int, terms: Iterable[Any], checker: dict[str, Any],
        memory_whole: bool, stats: dict[str, Any],
    ) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        for name in ("steps", "prefill_tokens", "retracted_reqs"):
            self.engine_stats.labels(stat=name).set(float(stats.get(name, 0)))
        for phase, seconds in stats.get("step_time_s", {}).items():
            self.step_phase.labels(phase=phase).set(float(seconds))
        for t in terms:
            for name in TERMS:
                self.kv_slots.labels(pool=t.pool, term=name).set(getattr(t, name))
            self.kv_balance.labels(pool=t.pool).set(t.balance)
        self.memory_whole.set(1 if memory_whole else 0)
        self.checker_level.set(checker.get("mem_check_level", 0))
        self.checker_steps.set(checker.get("steps_checked", 0))
        self.checker_idle.set(checker.get("idle_checks", 0))

    def serving_started(self) -> None:
        """On the event loop thread, as the server starts: CPU counted from here on."""
        self._cpu0 = _process_cpu()
        self._http_cpu0 = time.thread_time()

    def loop_times(self, parts: dict[str, float]) -> None:
        """On the event loop thread (the /metrics handler)."""
        for name, value in parts.items():
            self.loop_time.labels(part=name).set(value)
        self.loop_time.labels(part="process_cpu").set(_process_cpu() - self._cpu0)
        self.loop_time.labels(part="http_loop_cpu").set(time.thread_time() - self._http_cpu0)

    def set_engine_up(self, up: bool) -> None:
        self.engine_up.set(1 if up else 0)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


def _process_cpu() -> float:
    cpu = os.times()
    return cpu.user + cpu.system
