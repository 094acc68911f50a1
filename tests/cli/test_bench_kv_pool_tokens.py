"""`plugserve bench --kv-pool-tokens N` reaches the workload's engines (sessions sizes its
pool from it instead of from the conversations), and workloads that size pools themselves
refuse it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = {"PLUGSERVE_PLUGINS": "checker"}


def test_a_pool_too_small_for_the_sessions_says_so(cli: Callable[..., Any],
                                                   tiny_model_dir: Path) -> None:
    args = ["bench", "sessions", "--model", str(tiny_model_dir), "--sessions", "4", "--turns",
            "6", "--turn-input-len", "8", "--turn-output-len", "8", "--json"]
    assert cli(*args, env=ENV).exit_code == 0  # the default pool keeps every conversation
    run = cli(*args, "--kv-pool-tokens", "120", env=ENV)
    assert run.exit_code == 1
    assert "idle streaming sessions hold" in run.stderr and "of 120 free" in run.stderr


def test_long_context_sizes_its_pools_itself(cli: Callable[..., Any],
                                             tiny_model_dir: Path) -> None:
    run = cli("bench", "long-context", "--model", str(tiny_model_dir), "--kv-pool-tokens",
              "100", env=ENV)
    assert run.exit_code == 1
    assert "bench long-context chooses --kv-pool-tokens itself" in run.stderr
