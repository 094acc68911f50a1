"""Benchmarks shipped with the package (`plugserve bench WORKLOAD`).

workloads      the workloads by name: throughput, shared_prefix, spec (one module each)
runner         start and warm up engines, drive timed runs with a progress bar
metrics        req/s, tok/s, TTFT, ITL, TPOT, step-time groups, speculation figures
hf             the same prompts through HF transformers `generate` (--compare transformers)
serving        `bench serving`: an online benchmark against a running server (HTTP, SSE)
report, plot   rich tables and a matplotlib chart of a report (the JSON document)
"""

from __future__ import annotations
