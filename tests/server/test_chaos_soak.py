"""The chaos soak (`benchmarks/chaos_soak.py`), small: 150 requests, 32 concurrent, against a
`plugserve serve` subprocess on the tiny model with a KV pool small enough to retract, the
checker at level 1 with physical checks. No 5xx but 503, no protocol violation, no leak,
memory whole at idle, a clean exit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_soak.py"


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos_soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_chaos_soak_small(tiny_model_dir: Path) -> None:
    soak = load_soak()
    report = soak.run_config("plain", ["--model", str(tiny_model_dir)], requests=150,
                             concurrency=32, kv_pool_tokens=1536, threads=1)
    assert report["violations"] == []
    assert report["server_errors"] == {}
    assert report["leaks"] == 0 and report["memory_whole_at_idle"] is True
    assert report["server_exit_code"] == 0 and report["ok"] is True
    assert report["served"] > 75 and report["disconnects"] > 0
    assert sum(report["client_errors"].values()) > 0
    assert report["retracted"] > 0  # the small pool forced retracts
    assert report["aborted"] >= 1
    assert report["checker_steps"] > 0
