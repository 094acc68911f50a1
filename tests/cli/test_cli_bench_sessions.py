"""`plugserve bench sessions` on the tiny model: the report's fields, and that a session turn
computes only its new tokens (and the previous reply's last token, whose KV no forward wrote).

Tests the command and its report, not the speed. Runs with `--mem-check 1`, so
plugserve-checker must be installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.bench.sessions import print_tables

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {"PLUGSERVE_PLUGINS": "checker"}
SESSIONS, TURNS, NEW, OUT = 2, 3, 5, 4
PER_TURN = {"latency_s", "ttft_s", "cpu_s", "prompt_tokens", "prefill_tokens_computed",
            "cached_tokens"}


def test_report(cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path,
                capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "sessions.png"
    run = cli("bench", "sessions", "--model", str(tiny_model_dir), "--sessions", str(SESSIONS),
              "--turns", str(TURNS), "--turn-input-len", str(NEW), "--turn-output-len", str(OUT),
              "--mem-check", "1", "--json", "--plot", str(plot), env=ENV)
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    work = report["workload"]
    assert work["name"] == "sessions"
    assert (work["sessions"], work["turns"], work["turn_input_len"], work["turn_output_len"]) == (
        SESSIONS, TURNS, NEW, OUT)
    assert work["conversation_len"] == TURNS * (NEW + OUT)
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"sessions", "resend"}
    assert runs["sessions"]["settings"] == {"cache": "streaming_session", "sessions": True}
    assert runs["resend"]["settings"] == {"cache": "radix", "sessions": False}
    history = [t * (NEW + OUT) + NEW for t in range(TURNS)]  # the whole conversation per turn
    for r in runs.values():
        assert r["requests"] == SESSIONS * TURNS and r["output_tokens"] == SESSIONS * TURNS * OUT
        assert r["output_tok_per_s"] > 0 and r["ttft_s"]["mean"] > 0
        per_turn = r["per_turn"]
        assert set(per_turn) == PER_TURN
        assert all(len(v) == TURNS for v in per_turn.values())
        assert all(v > 0 for v in per_turn["latency_s"] + per_turn["ttft_s"])
        assert per_turn["prompt_tokens"] == history
        assert r["head_latency_s"] > 0 and r["tail_latency_s"] > 0
        assert r["tail_over_head"] == pytest.approx(r["tail_latency_s"] / r["head_latency_s"])
        assert r["cpu_tail_over_head"] > 0
    # With sessions a turn computes its new tokens, plus the previous reply's last token.
    assert runs["sessions"]["per_turn"]["prefill_tokens_computed"] == [NEW] + [NEW + 1] * (
        TURNS - 1)
    assert runs["sessions"]["per_turn"]["cached_tokens"] == [0] + [h - NEW - 1
                                                                   for h in history[1:]]
    assert runs["sessions"]["computed_per_later_turn"] == NEW + 1
    summary = report["summary"]
    assert summary["head_turns"] == TURNS
    assert set(summary["targets"]) == {"tail_over_head_le_1.1", "computed_eq_new_tokens_plus_1",
                                       "tail_lower_than_resend", "late_ttft_le_half_resend"}
    assert summary["late_ttft_sessions_over_resend"] == pytest.approx(
        summary["late_ttft_s"]["sessions"] / summary["late_ttft_s"]["resend"])
    assert summary["targets"]["computed_eq_new_tokens_plus_1"] is True
    assert summary["same_outputs"] is True  # greedy: sessions change no token
    assert plot.read_bytes().startswith(PNG_MAGIC)
    print_tables(report)
    out = capsys.readouterr().out
    assert "per turn (mean over sessions" in out and "targets: sessions tail / head" in out
    assert "late-turn TTFT (last 3 turns)" in out


def test_background_traffic_evicts_resent_histories_not_sessions(
        cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    """Other users' one-shot requests between rounds, in a pool that cannot keep both: with
    sessions every later turn still computes only its new tokens (+1), while re-sending finds
    less of its history cached than it sent before the latest reply."""
    turns, background, length = 4, 3, 40
    run = cli("bench", "sessions", "--model", str(tiny_model_dir), "--sessions", str(SESSIONS),
              "--turns", str(turns), "--turn-input-len", str(NEW), "--turn-output-len", str(OUT),
              "--background-prompts", str(background), "--background-len", str(length),
              "--kv-pool-tokens", "160", "--mem-check", "1", "--json", env=ENV)
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    assert (report["workload"]["background_prompts"],
            report["workload"]["background_len"]) == (background, length)
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["sessions"]["per_turn"]["prefill_tokens_computed"] == [NEW] + [NEW + 1] * (
        turns - 1)
    resend = runs["resend"]["per_turn"]
    history = [t * (NEW + OUT) for t in range(turns)]  # what earlier turns left
    assert resend["prompt_tokens"] == [h + NEW for h in history]
    assert any(cached < h - 1 for cached, h in zip(resend["cached_tokens"][1:], history[1:],
                                                  strict=True)), resend["cached_tokens"]
    assert report["summary"]["same_outputs"] is True


def test_refusals(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    model = ["--model", str(tiny_model_dir)]
    cases = [
        (["throughput", "--turns", "3"], "--turns does not apply to bench throughput"),
        (["sessions", "--num-seqs", "3"], "--num-seqs does not apply to bench sessions"),
        (["sessions", "--cache", "radix"], "bench sessions chooses --cache itself"),
        (["sessions", "--turns", "0"], "invalid benchmark options: turns must be >= 1"),
        (["sessions", "--background-prompts", "-1"],
         "invalid benchmark options: background_prompts must be >= 0"),
        (["throughput", "--background-len", "8"],
         "--background-len does not apply to bench throughput"),
        (["sessions", "--turns", "1", "--compare", "transformers"],
         "bench sessions has no --compare"),
    ]
    for args, message in cases:
        run = cli("bench", *args, *model, env=ENV)
        assert run.exit_code == 1, (args, run.stderr)
        assert message in run.stderr, (args, run.stderr)
