"""`plugserve bench WORKLOAD`: every workload's report has every field, on the tiny model.

These test the command and its report, not the speed. The runs use `--mem-check 1`, so
plugserve-checker must be installed; the spec run needs plugserve-spec-eagle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from plugserve.bench.metrics import (
    itl_values,
    latency_metrics,
    percentile,
    spec_metrics,
    step_breakdown,
)
from plugserve.bench.report import print_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_FIELDS = {
    "name", "requests", "seconds", "prompt_tokens", "output_tokens", "request_per_s",
    "input_tok_per_s", "output_tok_per_s", "ttft_s", "itl_s", "tpot_s", "step_time",
    "engine_counters", "settings",
}
SPEC_FIELDS = {
    "verify_rounds", "accepted_tokens", "accept_len", "accept_hist",
    "target_forwards_per_token", "speedup_vs_plain", "lossless",
}



@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    return make_tiny_head_dir(tiny_model_dir, tmp_path_factory.mktemp("head"), trained=False)


def bench(cli: Callable[..., Any], *args: str, plugins: str = "checker") -> dict[str, Any]:
    run = cli("bench", *args, "--mem-check", "1", "--json", env={"PLUGSERVE_PLUGINS": plugins})
    assert run.exit_code == 0, run.stderr
    report: dict[str, Any] = json.loads(run.stdout)
    return report


def assert_run_fields(run: dict[str, Any]) -> None:
    assert RUN_FIELDS <= set(run), RUN_FIELDS - set(run)
    assert run["requests"] > 0 and run["seconds"] > 0
    for key in ("request_per_s", "input_tok_per_s", "output_tok_per_s"):
        assert run[key] > 0, key
    assert set(run["ttft_s"]) == {"mean", "median", "p99"}
    assert set(run["itl_s"]) == {"mean", "median", "p95", "p99"}
    assert set(run["tpot_s"]) == {"mean"}
    assert all(v is not None and v >= 0 for v in [*run["ttft_s"].values(),
                                                   *run["itl_s"].values()])
    steps = run["step_time"]
    for group in ("schedule", "metadata", "forward", "sample", "post_process", "check"):
        assert group in steps["groups"], group
    assert {"schedule", "run", "post_process", "check", "forward"} <= set(steps["raw"])
    assert sum(g["fraction"] for g in steps["groups"].values()) == pytest.approx(1.0)
    assert run["engine_counters"]["prefill_tokens"] > 0


def test_throughput(cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "throughput.png"
    report = bench(cli, "throughput", "--model", str(tiny_model_dir), "--num-seqs", "3",
                   "--max-input-len", "24", "--max-output-len", "16", "--plot", str(plot))
    assert report["workload"]["name"] == "throughput"
    assert {"prompt_tokens", "output_tokens"} <= set(report["workload"])
    (run,) = report["runs"]
    assert_run_fields(run)
    assert run["output_tokens"] == report["workload"]["output_tokens"]
    assert plot.read_bytes().startswith(PNG_MAGIC)
    print_report(report)
    out = capsys.readouterr().out
    assert "TTFT mean" in out and "workload tokens:" in out


def test_prefill_against_transformers(cli: Callable[..., Any], tiny_model_dir: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    report = bench(cli, "prefill", "--model", str(tiny_model_dir), "--num-seqs", "2",
                   "--input-len", "40", "--compare", "transformers", "--hf-batch-sizes", "2")
    assert report["workload"] == {"name": "prefill", "num_seqs": 2, "input_len": 40, "seed": 0,
                                  "prompt_tokens": 80, "output_tokens": 2}
    (run,) = report["runs"]
    assert run["input_tok_per_s"] > 0 and run["output_tokens"] == 2
    assert run["ttft_s"]["mean"] > 0
    assert set(run["itl_s"].values()) == {None}  # one token each: no gaps between tokens
    assert run["engine_counters"]["prefill_tokens"] == 80
    assert report["transformers"]["output_tok_per_s"] > 0
    print_report(report)
    assert "workload tokens: 80 prompt, 2 output" in capsys.readouterr().out


def test_shared_prefix_against_transformers(
    cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plot = tmp_path / "shared.png"
    report = bench(
        cli, "shared-prefix", "--model", str(tiny_model_dir), "--groups", "2",
        "--prompts-per-group", "3", "--prefix-len", "40", "--question-len", "8",
        "--output-len", "4", "--compare", "transformers", "--hf-batch-sizes", "3,6",
        "--plot", str(plot),
    )
    work = report["workload"]
    assert (work["prompt_tokens"], work["unique_prompt_tokens"]) == (2 * 3 * 48, 2 * 40 + 6 * 8)
    runs = {r["settings"]["cache"]: r for r in report["runs"]}
    assert set(runs) == {"radix", "none"}
    for run in runs.values():
        assert_run_fields(run)
        assert run["output_tokens"] == 6 * 4
        assert run["vs_transformers"] > 0
    # Without the cache every prompt token is computed; with it, each prefix once.
    assert runs["none"]["prefill_tokens_computed"] == work["prompt_tokens"]
    assert runs["radix"]["prefill_tokens_computed"] < work["prompt_tokens"]
    summary = report["summary"]
    assert summary["prompt_tokens_unique"] == work["unique_prompt_tokens"]
    assert summary["ttft_ratio"] == pytest.approx(
        runs["radix"]["ttft_s"]["mean"] / runs["none"]["ttft_s"]["mean"])
    assert set(summary["targets"]) == {"computed_le_1.1x_unique", "ttft_ratio_le_0.3"}
    hf = report["transformers"]
    assert hf["output_tokens"] == 6 * 4 and [t["batch_size"] for t in hf["tries"]] == [3, 6]
    assert plot.read_bytes().startswith(PNG_MAGIC)
    print_report(report)
    out = capsys.readouterr().out
    assert "prefix reuse" in out and "TTFT with cache / without" in out
    assert "plugserve / transformers" in out


@pytest.mark.integration  # runs the eagle plugin
def test_spec(cli: Callable[..., Any], tiny_model_dir: Path, head_dir: Path, tmp_path: Path,
              capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "spec.png"
    report = bench(
        cli, "spec", "--model", str(tiny_model_dir), "--draft-model", str(head_dir),
        "--spec-prompts", "2", "--output-len", "5", "--plot", str(plot),
        plugins="checker,eagle",
    )
    runs = report["runs"]
    keys = {(r["settings"]["method"], r["settings"]["page_size"], r["settings"]["batch_size"])
            for r in runs}
    assert keys == {(m, p, b) for m in ("plain", "chain", "tree") for p in (1, 16)
                    for b in (1, 8)}
    for run in runs:
        assert_run_fields(run)
        assert SPEC_FIELDS <= set(run), SPEC_FIELDS - set(run)
        assert run["output_tokens"] == 2 * 5
        assert run["lossless"] is True
        if run["settings"]["method"] == "plain":
            assert run["accept_len"] is None and run["verify_rounds"] == 0
            assert run["target_forwards_per_token"] == pytest.approx(1.0)
            assert run["speedup_vs_plain"] == 1.0
        else:
            assert run["accept_len"] >= 1.0 and run["verify_rounds"] > 0
            assert 0 < run["target_forwards_per_token"] <= 1.0
            assert {"draft", "verify", "accept"} <= set(run["step_time"]["groups"])
    summary = report["summary"]
    assert summary["lossless"] is True
    assert set(summary["batch1_speedup_vs_plain"]) == {
        f"{m} page={p}" for m in ("chain", "tree") for p in (1, 16)
    }
    assert plot.read_bytes().startswith(PNG_MAGIC)
    print_report(report)
    out = capsys.readouterr().out
    assert "accept len" in out and "lossless (spec tokens == plain tokens): yes" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "decode"],
         "error: unknown workload 'decode'; choose one of: throughput, shared-prefix, spec"),
        (["bench", "spec", "--page-size", "4", "--spec", "eagle"],
         "error: bench spec chooses --spec, --page-size itself; leave them out"),
        (["bench", "shared-prefix", "--cache", "none"],
         "error: bench shared-prefix chooses --cache itself; leave it out"),
        (["bench", "spec", "--num-seqs", "4"],
         "error: --num-seqs does not apply to bench spec; its options: --spec-prompts, "
         "--output-len"),
        (["bench", "--groups", "2"], "error: --groups does not apply to bench throughput"),
        (["bench", "prefill", "--max-input-len", "64"],
         "error: --max-input-len does not apply to bench prefill; its options: --num-seqs, "
         "--input-len, --num-iters, --seed"),
        (["bench", "prefill", "--input-len", "0"],
         "error: invalid benchmark options: input_len must be >= 1, got 0"),
        (["bench", "prefill", "--num-iters", "0"],
         "error: invalid benchmark options: num_iters must be >= 1, got 0"),
        (["bench", "shared-prefix", "--prefix-len", "0"],
         "error: invalid benchmark options: prefix_len must be >= 1, got 0"),
        (["bench", "spec", "--model", "/nonexistent-model"],
         "error: unsupported configuration for spec run 'chain page=1': speculative "
         "algorithm 'eagle' needs a draft model"),
    ],
)
@pytest.mark.integration  # the spec workload names the eagle plugin
def test_bad_arguments(cli: Callable[..., Any], args: list[str], message: str) -> None:
    run = cli(*args, env={"PLUGSERVE_PLUGINS": "eagle"})
    assert run.exit_code == 1, run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith(message), run.stderr


def test_help_lists_the_workloads(cli: Callable[..., Any]) -> None:
    run = cli("bench", "--help")
    assert run.exit_code == 0
    for text in ("throughput", "prefill", "shared-prefix", "spec", "--plot", "a gap of 0"):
        assert text in run.stdout, text


# --- metrics from Req-like objects -----------------------------------------------------------


def fake_req(created: float, times: list[float], rounds: int = 0, accepted: int = 0) -> Any:
    return SimpleNamespace(
        created_s=created, first_token_s=times[0], token_times_s=times, finished_s=times[-1],
        output_ids=list(range(len(times))), origin_input_ids=[1, 2, 3],
        spec_verify_steps=rounds, spec_accepted_tokens=accepted, spec_accept_hist={},
    )


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_latency_metrics() -> None:
    # One speculative round emits tokens 2-4 together: their gaps are 0.
    spec = fake_req(0.0, [1.0, 2.0, 2.0, 2.0, 3.0], rounds=2, accepted=2)
    plain = fake_req(0.5, [1.0, 1.5])
    assert itl_values([spec, plain]) == [1.0, 0.0, 0.0, 1.0, 0.5]
    out = latency_metrics([spec, plain])
    assert out["ttft_s"]["mean"] == pytest.approx((1.0 + 0.5) / 2)
    assert out["itl_s"]["median"] == pytest.approx(0.5)
    assert out["tpot_s"]["mean"] == pytest.approx((2.0 / 4 + 0.5 / 1) / 2)
    figures = spec_metrics([spec, plain])
    assert figures["accept_len"] == pytest.approx((2 + 2) / 2)
    # spec: (1 prefill + 2 rounds) / 5 tokens; plain: one forward per token.
    assert figures["target_forwards_per_token"] == pytest.approx((3 / 5 + 1.0) / 2)


def test_step_breakdown_groups_the_phases() -> None:
    raw = {"schedule": 1.0, "run": 6.0, "post_process": 0.5, "check": 0.5, "prepare": 0.25,
           "metadata": 0.25, "forward": 3.0, "sample": 0.5, "draft": 0.5, "verify": 1.0}
    out = step_breakdown(raw)
    groups = {name: g["seconds"] for name, g in out["groups"].items()}
    assert groups == {"schedule": 1.0, "metadata": 0.5, "forward": 3.0, "sample": 0.5,
                      "draft": 0.5, "verify": 1.0, "post_process": 0.5, "check": 0.5,
                      "other": 0.5}
    assert out["total_s"] == pytest.approx(8.0)
    assert out["groups"]["forward"]["fraction"] == pytest.approx(3.0 / 8.0)
    assert out["raw"] == raw
