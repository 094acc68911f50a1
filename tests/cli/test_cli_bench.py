"""`plugserve bench` (throughput): the fixed workload's checksum, a tiny run against
transformers. The other workloads: test_cli_bench_workloads.py.

The run uses `--mem-check 1`, so plugserve-checker must be installed
(`pip install --no-deps -e plugins/checker`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.bench.hf import Comparison
from plugserve.bench.report import print_report
from plugserve.bench.throughput import BenchOptions, make_workload

ROOT = Path(__file__).resolve().parents[2]


def test_default_workload_matches_its_checksum() -> None:
    workload = make_workload(BenchOptions())
    assert len(workload.prompts) == 64
    assert (workload.prompt_tokens, workload.output_tokens) == (9536, 8224)


def test_workload_is_the_documented_random_sequence() -> None:
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(16, 256))] for _ in range(64)
    ]
    max_new = [random.randint(16, 256) for _ in range(64)]
    workload = make_workload(BenchOptions())
    assert workload.prompts == prompts and workload.max_new == max_new


def test_small_vocabularies_keep_the_lengths() -> None:
    workload = make_workload(BenchOptions(num_seqs=4, max_input_len=32, max_output_len=16))
    folded = workload.within_vocab(261)
    assert [len(p) for p in folded.prompts] == [len(p) for p in workload.prompts]
    assert max(max(p) for p in folded.prompts) < 261
    assert workload.within_vocab(49152) is workload


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_seqs": 0}, "num_seqs must be >= 1, got 0"),
        ({"max_output_len": 15}, "max_output_len must be >= 16, got 15"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchOptions(**kwargs)


def test_bad_hf_batch_sizes() -> None:
    with pytest.raises(ValueError, match="hf_batch_sizes needs a size"):
        Comparison((0,))


def test_bench_against_transformers(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    run = cli(
        "bench",
        "--model",
        str(tiny_model_dir),
        "--num-seqs",
        "3",
        "--max-input-len",
        "24",
        "--max-output-len",
        "16",
        "--compare",
        "transformers",
        "--hf-batch-sizes",
        "1,3",
        "--mem-check",
        "1",
        "--json",
        env={"PLUGSERVE_PLUGINS": "checker"},
    )
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    workload = make_workload(BenchOptions(num_seqs=3, max_input_len=24, max_output_len=16))
    assert report["workload"]["output_tokens"] == workload.output_tokens
    (engine,), hf = report["runs"], report["transformers"]
    assert engine["output_tokens"] == hf["output_tokens"] == workload.output_tokens
    assert engine["prompt_tokens"] == workload.prompt_tokens
    assert [t["batch_size"] for t in hf["tries"]] == [1, 3]
    assert hf["batch_size"] in (1, 3)
    assert engine["vs_transformers"] == pytest.approx(
        engine["output_tok_per_s"] / hf["output_tok_per_s"]
    )

    print_report(report)  # the table renders from the same document


def test_report_table(capsys: pytest.CaptureFixture[str]) -> None:
    from plugserve.bench.metrics import step_breakdown

    run = {
        "name": "plugserve", "requests": 4, "seconds": 2.0, "prompt_tokens": 100,
        "output_tokens": 64, "request_per_s": 2.0, "input_tok_per_s": 50.0,
        "output_tok_per_s": 32.0, "ttft_s": {"mean": 0.1, "median": 0.1, "p99": 0.2},
        "itl_s": {"mean": 0.01, "median": 0.01, "p95": 0.02, "p99": 0.03},
        "tpot_s": {"mean": 0.01}, "step_time": step_breakdown({"forward": 1.5, "run": 1.5}),
        "vs_transformers": 2.0,
    }
    report = {
        "workload": {"name": "throughput", "num_seqs": 4, "prompt_tokens": 100,
                     "output_tokens": 64},
        "runs": [run],
        "transformers": {"requests": 4, "prompt_tokens": 100, "output_tokens": 64,
                         "seconds": 4.0, "output_tok_per_s": 16.0, "batch_size": 4},
    }
    print_report(report)
    out = capsys.readouterr().out
    assert "output tok/s" in out and "32.0" in out and "16.0" in out
    assert "plugserve / transformers (output tok/s): plugserve 2.00x" in out


def test_benchmarks_script_is_a_thin_wrapper() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--compare" in done.stdout and "--num-seqs" in done.stdout


def test_rejected_request_is_a_user_error(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    """The workload's first prompt (880 tokens) is longer than the tiny model's context."""
    work = make_workload(BenchOptions(num_seqs=2, max_input_len=1000, max_output_len=16))
    assert len(work.prompts[0]) == 880
    run = cli("bench", "--model", str(tiny_model_dir), "--num-seqs", "2", "--max-input-len",
              "1000", "--max-output-len", "16", env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1, run.stderr
    (line,) = run.stderr_lines
    assert line.startswith(
        "error: bench run 'plugserve': request 0 (880 prompt tokens, max_new_tokens=16) was "
        "rejected by the engine: prompt has 880 tokens; the context holds "
    ), line
    assert "--debug" not in line and "Error" not in line


def plot_cases(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "file.txt").write_text("")
    return {
        "missing folder": (tmp / "missing" / "p.png",
                           f"its folder {str(tmp / 'missing')!r} does not exist; create it first"),
        "a folder": (tmp, f"it is a folder; give a file name such as {tmp / 'bench.png'}"),
        "under a file": (tmp / "file.txt" / "p.png",
                         f"{str(tmp / 'file.txt')!r} is not a folder"),
    }


@pytest.mark.parametrize("case", ["missing folder", "a folder", "under a file"])
def test_unwritable_plot_fails_before_any_engine(
    cli: Callable[..., Any], tmp_path: Path, case: str
) -> None:
    path, why = plot_cases(tmp_path)[case]
    # A missing model would fail when the first engine starts: the plot error comes first.
    run = cli("bench", "--model", str(tmp_path / "no-model"), "--plot", str(path),
              env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1, run.stderr
    assert run.stderr_lines == [f"error: --plot {str(path)!r} cannot be written: {why}"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_plot_in_a_read_only_folder(cli: Callable[..., Any], tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    try:
        run = cli("bench", "--plot", str(folder / "p.png"), env={"PLUGSERVE_PLUGINS": ""})
    finally:
        folder.chmod(0o700)
    assert run.exit_code == 1
    assert run.stderr_lines == [f"error: --plot {str(folder / 'p.png')!r} cannot be written: "
                                f"its folder {str(folder)!r} is not writable"]


def test_plot_write_error_after_the_run_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import plugserve.bench.plot
    from plugserve.cli.bench import write_plot
    from plugserve.cli.errors import UsageError, describe_error

    def refuse(report: dict[str, Any], path: Any) -> Path:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(plugserve.bench.plot, "write_plot", refuse)
    with pytest.raises(UsageError) as info:
        write_plot({}, tmp_path / "p.png")
    assert describe_error(info.value) == (
        f"--plot {str(tmp_path / 'p.png')!r} could not be written: Permission denied"
    )
