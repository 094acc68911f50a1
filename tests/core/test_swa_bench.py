"""`plugserve bench long-context`, small: the SWA pools fit several times the requests of one
full pool under the same KV bytes (measured by running them), and a running request holds
at most window + 2 pages of SWA KV."""

from __future__ import annotations

from plugserve.bench.long_context import LongContextOptions, run
from plugserve.bench.runner import Runner
from plugserve.config import EngineConfig


def test_swa_pools_fit_more_requests() -> None:
    options = LongContextOptions(num_seqs=8, context_len=512, output_len=8, window=64,
                                 page_size=16, chunk=64, kv_budget_mib=2)
    report = run(Runner(EngineConfig(), ()), options, None)
    swa, full = report["runs"]
    assert swa["kv_bytes"] <= (2 << 20) + 64 * 1024 and full["kv_bytes"] <= (2 << 20) + 64 * 1024
    assert report["summary"]["targets"]["swa_per_request_le_window_plus_2_pages"]
    assert report["summary"]["concurrency_ratio"] >= 2.5
    assert swa["peak_slots_used"]["swa"] < swa["peak_slots_used"]["full"]
