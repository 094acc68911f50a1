"""`plugserve bench serving` against a live server on the tiny model: the report's figures
add up, and bad options are one line each."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plugserve.cli import app
from plugserve.server.background import BackgroundServer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_bench_serving_report(server: BackgroundServer, tmp_path: Path) -> None:
    plot = tmp_path / "serving.png"
    run = invoke("bench", "serving", "--base-url", server.url, "--num-seqs", "6",
                 "--request-rate", "50,inf", "--input-len", "24", "--output-len", "8",
                 "--goodput", "ttft:60000,tpot:60000", "--plot", str(plot), "--json")
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    work = report["workload"]
    assert work["endpoint"] == "/v1/completions" and work["model"] == server.app.state.server.model_id
    assert [r["name"] for r in report["runs"]] == ["rate 50", "rate inf"]
    for r in report["runs"]:
        assert (r["requests"], r["failed"]) == (6, 0)
        assert r["prompt_tokens"] == 6 * 24  # token-id prompts: exact lengths
        assert r["output_tokens"] == 6 * 8  # EOS ignored
        assert r["output_tok_per_s"] == pytest.approx(48 / r["seconds"])
        assert 0 < r["ttft_s"]["median"] <= r["ttft_s"]["p99"] <= r["e2el_s"]["p99"]
        assert r["itl_s"]["mean"] == pytest.approx(r["tpot_s"]["mean"], rel=1e-6)
        assert r["goodput_req_per_s"] == pytest.approx(r["request_per_s"])  # generous limits
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_bench_serving_chat_tables(server: BackgroundServer) -> None:
    run = invoke("bench", "serving", "--base-url", server.url, "--num-seqs", "3",
                 "--dataset", "chat", "--max-concurrency", "2", "--output-len", "4")
    assert run.exit_code == 0, run.stderr
    assert "rate inf, concurrency 2" in run.stdout
    assert "TTFT mean" in run.stdout and "TPOT mean" in run.stdout
    assert "rate inf, concurrency 2: 3 served, 0 failed" in run.stdout


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "serving"], "error: invalid benchmark options: bench serving needs --base-url"),
        (["bench", "serving", "--base-url", "http://127.0.0.1:1", "--model", "m"],
         "error: --model does not apply to bench serving"),
        (["bench", "serving", "--base-url", "http://x", "--request-rate", "fast"],
         "error: invalid benchmark options: request rates must be numbers"),
        (["bench", "serving", "--base-url", "http://x", "--request-rate", "0"],
         "error: invalid benchmark options: request rates must be > 0"),
        (["bench", "serving", "--base-url", "http://x", "--goodput", "ttft=5"],
         "error: invalid benchmark options: goodput must look like ttft:500"),
        (["bench", "serving", "--base-url", "http://x", "--dataset", "sharegpt"],
         "error: invalid benchmark options: dataset must be random or chat"),
        (["bench", "throughput", "--base-url", "http://x"],
         "error: --base-url does not apply to bench throughput"),
        (["bench", "nope"], "error: unknown workload 'nope'; choose one of: throughput, "),
    ],
)
def test_bench_serving_bad_options(args: list[str], message: str) -> None:
    run = invoke(*args)
    assert run.exit_code == 1
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith(message), run.stderr
    if "unknown workload" in message:
        assert run.stderr.rstrip().endswith(", serving"), run.stderr


def test_bench_serving_no_server() -> None:
    run = invoke("bench", "serving", "--base-url", f"http://127.0.0.1:{closed_port()}")
    assert run.exit_code == 1
    assert "no OpenAI-compatible server answers at http://127.0.0.1:" in run.stderr
