"""`plugserve bench --compare vllm --vllm-python PATH`, without vLLM.

The "vLLM interpreter" here is a shell script that runs this environment's Python with a fake
`vllm` package first on the path: its `LLM.generate` returns transformers' greedy tokens (so
they equal the engine's), optionally with one token changed or a failure. The real driver
script (core/bench/vllm_driver.py) runs under it, so the JSON protocol, the environment and
the error messages are the real ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from plugserve.bench.report import print_report
from plugserve.bench.runner import Measured
from plugserve.bench.throughput import ThroughputOptions, make_workload
from plugserve.bench.vllm import (
    DRIVER,
    SETUP_HINT,
    add_vllm_comparison,
    agreement,
    cpu_list,
    driver_env,
)

FAKE_VLLM = '''
"""A stand-in for vLLM: transformers' greedy tokens; FAKE_VLLM_* env vars change it."""
import json, os, sys

__version__ = "0.0.fake"
print("fake vllm: noise on stdout that must not reach the result")


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, model, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("fake vLLM failed to start")
        self.model = model
        self.kwargs = kwargs
        print("fake vllm: loading", model)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        from plugserve.testing.reference import hf_greedy

        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        assert all(p.temperature == 0.0 and p.ignore_eos for p in params)
        ids = [p["prompt_token_ids"] for p in prompts]
        tokens = hf_greedy(self.model, ids, [p.max_tokens for p in params])
        flip = os.environ.get("FAKE_VLLM_FLIP")
        if flip is not None and len(tokens[0]) > int(flip):
            tokens[0][int(flip)] += 1
        record = os.environ.get("FAKE_VLLM_RECORD")
        if record and len(prompts) > 2 and not os.path.exists(record):  # the timed call
            with open(record, "w") as f:
                json.dump({"prompts": ids, "max_new": [p.max_tokens for p in params],
                           "llm": self.kwargs, "model": self.model,
                           "env": {k: v for k, v in os.environ.items()
                                   if k.startswith("VLLM_CPU_")}}, f)
        return [_Output(t) for t in tokens]

    def reset_prefix_cache(self):
        return True
'''


def make_interpreter(folder: Path, with_vllm: bool = True) -> Path:
    """An executable that runs this Python, with the fake vllm importable when asked."""
    folder.mkdir(parents=True, exist_ok=True)
    path_line = ""
    if with_vllm:
        package = folder / "site" / "vllm"
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(FAKE_VLLM)
        path_line = f'PYTHONPATH="{folder / "site"}${{PYTHONPATH:+:$PYTHONPATH}}"\nexport PYTHONPATH\n'
    python = folder / "bin" / "python"
    python.parent.mkdir(exist_ok=True)
    python.write_text(f'#!/bin/sh\n{path_line}exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture(autouse=True)
def _no_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the fake interpreter's allocator as it is (no tcmalloc or libiomp preloading)."""
    monkeypatch.setenv("LD_PRELOAD", "")
    for name in ("FAKE_VLLM_FAIL", "FAKE_VLLM_FLIP", "FAKE_VLLM_RECORD"):
        monkeypatch.delenv(name, raising=False)


def test_agreement_counts_positions_and_the_common_prefix() -> None:
    mine = [[1, 2, 3, 4], [5, 6], list(range(40))]
    theirs = [[1, 9, 3, 4], [5, 6], list(range(40))]
    got = agreement(mine, theirs, first=32)
    assert got["compared"] == 4 + 2 + 32
    assert got["agree"] == 3 + 2 + 32
    assert got["fraction"] == pytest.approx(37 / 38)
    assert got["common_prefix_mean"] == pytest.approx((1 + 2 + 32) / 3)
    assert (got["requests_identical"], got["requests"]) == (2, 3)
    with pytest.raises(ValueError, match="2 requests against 1"):
        agreement([[1], [2]], [[1]])


def test_cpu_list() -> None:
    assert cpu_list([0, 1]) == "0-1"
    assert cpu_list({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"
    assert cpu_list([3]) == "3"
    assert cpu_list([]) == ""


def test_driver_env_binds_every_core_and_keeps_what_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_text("")
    env = driver_env(python, 4, {"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "venv" / "lib" / "libiomp5.so")
    mine = {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "LD_PRELOAD": ""}
    assert {k: driver_env(python, 4, mine)[k] for k in mine} == mine


def _measured(label: str, prompts: list[list[int]], outputs: list[list[int]]) -> Measured:
    reqs = [SimpleNamespace(origin_input_ids=p, output_ids=o)
            for p, o in zip(prompts, outputs, strict=True)]
    return Measured(label, reqs, 1.0, {}, {})  # type: ignore[arg-type]


def _run(name: str, rate: float) -> dict[str, Any]:
    from plugserve.bench.metrics import step_breakdown

    return {
        "name": name, "requests": 2, "seconds": 2.0, "prompt_tokens": 10, "output_tokens": 40,
        "request_per_s": 1.0, "input_tok_per_s": 5.0, "output_tok_per_s": rate,
        "ttft_s": {"mean": 0.1, "median": 0.1, "p99": 0.2},
        "itl_s": {"mean": 0.01, "median": 0.01, "p95": 0.02, "p99": 0.03},
        "tpot_s": {"mean": 0.01}, "step_time": step_breakdown({"forward": 1.5, "run": 1.5}),
    }


def test_ratios_agreement_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    outputs = [list(range(20)), list(range(100, 120))]
    other_prompts = [[7, 7], [8, 8]]
    measured = [_measured("cache=radix", prompts, outputs),
                _measured("cache=none", other_prompts, outputs)]
    report: dict[str, Any] = {
        "workload": {"name": "throughput", "num_seqs": 2, "prompt_tokens": 10,
                     "output_tokens": 40},
        "runs": [_run("cache=radix", 30.0), _run("cache=none", 15.0)],
        "transformers": {"requests": 2, "prompt_tokens": 10, "output_tokens": 40,
                         "seconds": 4.0, "output_tok_per_s": 10.0, "batch_size": 2},
    }
    for run in report["runs"]:
        run["vs_transformers"] = run["output_tok_per_s"] / 10.0
    theirs = [list(range(20)), list(range(100, 110)) + [0] * 10]
    result = {"requests": 2, "prompt_tokens": 10, "output_tokens": 40, "seconds": 2.5,
              "output_tok_per_s": 20.0, "prefill_seconds": 0.25, "load_seconds": 30.0,
              "first_tokens": theirs, "vllm_version": "0.32.0", "reference_run": "cache=radix",
              "agreement_tokens": 32, "dtype": "float32", "python": "/v/bin/python"}
    add_vllm_comparison(report, result, measured)
    assert "first_tokens" not in report["vllm"]  # the token lists stay out of the JSON
    radix, none = report["runs"]
    assert radix["vs_vllm"] == pytest.approx(1.5) and none["vs_vllm"] == pytest.approx(0.75)
    agree = radix["vllm_agreement"]
    assert (agree["compared"], agree["agree"]) == (40, 30)
    assert agree["fraction"] == pytest.approx(0.75)
    assert agree["common_prefix_mean"] == pytest.approx(15.0)
    assert "vllm_agreement" not in none  # other prompts: nothing to compare
    json.dumps(report)

    print_report(report)
    out = capsys.readouterr().out
    assert "vs vLLM" in out and "vLLM 0.32.0 (CPU)" in out
    assert "plugserve / vLLM (output tok/s): cache=radix 1.50x, cache=none 0.75x" in out
    assert "first 32 greedy tokens equal to vLLM's: cache=radix 75.0% (common prefix 15.0 " \
           "tokens, 1 of 2 requests identical)" in out
    assert "plugserve / transformers (output tok/s): cache=radix 3.00x" in out


def test_driver_prints_only_its_result(tmp_path: Path, tiny_model_dir: Path) -> None:
    python = make_interpreter(tmp_path / "venv")
    work = {"model": str(tiny_model_dir), "dtype": "float32", "prompts": [[5, 6, 7], [8, 9]],
            "max_new": [4, 40], "first_tokens": 32}
    done = subprocess.run([str(python), str(DRIVER)], input=json.dumps(work),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()  # vLLM's own stdout went to stderr
    result = json.loads(line)
    assert "noise on stdout" in done.stderr
    assert result["output_tokens"] == 44 and result["requests"] == 2
    assert [len(t) for t in result["first_tokens"]] == [4, 32]
    assert result["vllm_version"] == "0.0.fake"
    assert result["output_tok_per_s"] == pytest.approx(44 / result["seconds"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_driver_without_vllm_says_so() -> None:
    done = subprocess.run([sys.executable, str(DRIVER)], input="{}", capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 3
    assert done.stdout == ""
    assert done.stderr.strip().startswith(f"vllm is not importable by {sys.executable}: ")


BENCH = ["bench", "--num-seqs", "3", "--max-input-len", "24", "--max-output-len", "40"]


def test_bench_against_vllm_and_transformers(
    cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    python = make_interpreter(tmp_path / "venv")
    record = tmp_path / "received.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setenv("FAKE_VLLM_FLIP", "5")  # request 0's sixth token differs
    run = cli(*BENCH, "--model", str(tiny_model_dir), "--compare", "transformers,vllm",
              "--hf-batch-sizes", "3", "--vllm-python", str(python), "--json",
              env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    (engine,), vllm, hf = report["runs"], report["vllm"], report["transformers"]
    assert engine["vs_vllm"] == pytest.approx(engine["output_tok_per_s"]
                                              / vllm["output_tok_per_s"])
    assert engine["vs_transformers"] == pytest.approx(engine["output_tok_per_s"]
                                                      / hf["output_tok_per_s"])

    work = make_workload(ThroughputOptions(num_seqs=3, max_input_len=24, max_output_len=40))
    received = json.loads(record.read_text())
    assert received["max_new"] == work.max_new  # the engine's lengths, greedy, EOS ignored
    assert [len(p) for p in received["prompts"]] == [len(p) for p in work.prompts]
    assert received["model"] == str(tiny_model_dir)
    assert received["llm"]["dtype"] == "float32"
    assert received["env"]["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(os.sched_getaffinity(0))
    assert received["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert vllm["output_tokens"] == engine["output_tokens"] == work.output_tokens
    assert vllm["reference_run"] == "plugserve" and vllm["python"] == str(python)

    agree = engine["vllm_agreement"]
    compared = sum(min(n, 32) for n in work.max_new)
    assert (agree["compared"], agree["agree"]) == (compared, compared - 1)
    prefixes = [5] + [min(n, 32) for n in work.max_new[1:]]
    assert agree["common_prefix_mean"] == pytest.approx(sum(prefixes) / 3)
    assert (agree["requests_identical"], agree["requests"]) == (2, 3)
    print_report(report)


def test_prefill_iterations_median_on_both_sides(
    cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --num-iters 3: three timed prefills of new prompts on each side, the median reported.
    python = make_interpreter(tmp_path / "venv")
    run = cli("bench", "prefill", "--model", str(tiny_model_dir), "--input-len", "24",
              "--num-iters", "3", "--compare", "vllm", "--vllm-python", str(python), "--json",
              env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["workload"]["num_iters"] == 3
    (engine,), vllm = report["runs"], report["vllm"]
    for times, median in ((engine["iteration_seconds"], engine["seconds"]),
                          (vllm["iteration_seconds"], vllm["seconds"])):
        assert len(times) == 3 and median == sorted(times)[1]
    assert engine["engine_counters"]["prefill_tokens"] == 24  # one iteration's work
    assert engine["vs_vllm"] == pytest.approx(engine["output_tok_per_s"]
                                              / vllm["output_tok_per_s"])
    assert engine["vllm_agreement"]["requests_identical"] == 1  # the first iteration's prompt
    print_report(report)
    assert "each run is the median of its timings (s): plugserve " in capsys.readouterr().out


def test_driver_failure_is_one_line_with_its_log(
    cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    python = make_interpreter(tmp_path / "venv")
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    run = cli(*BENCH, "--model", str(tiny_model_dir), "--compare", "vllm", "--vllm-python",
              str(python), env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1
    (line,) = run.stderr_lines
    head = (f"error: the vLLM driver failed under {str(python)!r} (exit 1): RuntimeError: "
            "fake vLLM failed to start; its log: ")
    assert line.startswith(head), line
    log = Path(line.removeprefix(head))
    assert "Traceback" in log.read_text()
    log.unlink()


def error_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    no_vllm = make_interpreter(tmp / "plain", with_vllm=False)
    missing = tmp / "missing" / "python"
    return {
        "no interpreter given": (
            ["--compare", "vllm"],
            f"error: --compare vllm needs --vllm-python PATH, an interpreter with vLLM: "
            f"{SETUP_HINT}",
        ),
        "interpreter without --compare vllm": (
            ["--compare", "transformers", "--vllm-python", str(no_vllm)],
            "error: --vllm-python applies only with --compare vllm",
        ),
        "unknown implementation": (
            ["--compare", "transformers,sglang"],
            "error: --compare 'sglang' is not supported; allowed: transformers, vllm, "
            "llamacpp",
        ),
        "no such interpreter": (
            ["--compare", "vllm", "--vllm-python", str(missing)],
            f"error: --vllm-python {str(missing)!r}: no such interpreter; {SETUP_HINT}",
        ),
        "a folder": (
            ["--compare", "vllm", "--vllm-python", str(tmp)],
            f"error: --vllm-python {str(tmp)!r} is not an executable Python interpreter; "
            f"{SETUP_HINT}",
        ),
        "vllm not installed there": (
            ["--compare", "vllm", "--vllm-python", str(no_vllm)],
            f"error: vllm is not installed for --vllm-python {str(no_vllm)!r}; {SETUP_HINT}",
        ),
    }


@pytest.mark.parametrize("case", ["no interpreter given", "interpreter without --compare vllm",
                                  "unknown implementation", "no such interpreter", "a folder",
                                  "vllm not installed there"])
def test_errors_come_before_any_engine(
    cli: Callable[..., Any], tmp_path: Path, case: str
) -> None:
    args, expected = error_cases(tmp_path)[case]
    # A missing model would fail when the first engine starts: these errors come first.
    run = cli("bench", "--model", str(tmp_path / "no-model"), *args,
              env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1, run.stderr
    assert run.stderr_lines == [expected]
    assert SETUP_HINT.startswith("run benchmarks/setup_vllm.sh")


def test_workloads_without_a_vllm_comparison(cli: Callable[..., Any], tmp_path: Path) -> None:
    python = make_interpreter(tmp_path / "venv")
    run = cli("bench", "sessions", "--model", str(tmp_path / "no-model"), "--compare", "vllm",
              "--vllm-python", str(python), env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1
    assert run.stderr_lines == [
        "error: --compare vllm applies to bench throughput, prefill, shared-prefix, spec, not sessions"
    ]


def test_the_plot_has_a_vllm_bar() -> None:
    from plugserve.bench.plot import panels

    report = {
        "workload": {"name": "throughput"},
        "runs": [{"name": "plugserve", "output_tok_per_s": 90.0}],
        "vllm": {"vllm_version": "0.32.0", "output_tok_per_s": 100.0},
    }
    (tok_s,) = panels(report)
    assert tok_s.labels == ["plugserve", "vLLM 0.32.0 (CPU)"]
    assert tok_s.values == [90.0, 100.0]
