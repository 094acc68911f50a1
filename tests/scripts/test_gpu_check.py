"""`scripts/gpu_check.sh` (`make gpu-check`) without a GPU: its plan names real tests,
backends and commands, and its runner reports and fails as it should.

No step of the plan can run here (they need CUDA); what is checked is everything short of
that: each pytest step selects tests that exist, each conformance step names a registered
backend and its command line parses, each bench command parses up to the device check and
its summary line reads a real bench document.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # the GPU check spans every GPU backend plugin

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
VENV_BIN = Path(sys.executable).parent


def _run(args: list[str], *, env: dict[str, str] | None = None, timeout: int = 120
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def plan() -> dict[str, str]:
    result = _run([str(SCRIPT), "--dry-run"], env={"PLUGSERVE_VENV": str(VENV_BIN.parent)})
    assert result.returncode == 0, result.stderr
    steps = dict(line.split("\t", 1) for line in result.stdout.splitlines())
    assert len(steps) == len(result.stdout.splitlines()), "step names must be unique"
    return steps


def test_plan_has_every_part_of_the_check(plan: dict[str, str]) -> None:
    assert list(plan)[:4] == ["setup", "torch-cuda", "gpu-extras", "device"]
    for name in ("gpu-tests", "conformance-triton", "conformance-flashinfer", "conformance-fa3",
                 "identity-torch_native", "identity-triton", "bench-triton"):
        assert name in plan
    assert "plugins/attention_flashinfer[cuda]" in plan["gpu-extras"]
    assert "plugins/attention_fa3[cuda]" in plan["gpu-extras"]
    assert all("--device cuda" in c for n, c in plan.items() if n.startswith(("conf", "bench")))
    assert all("PLUGSERVE_DEVICE=cuda" in c for n, c in plan.items() if n.startswith("identity"))


def _pytest_args(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment, pytest arguments) of a plan command running `python -m pytest`."""
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    start = words.index("pytest") + 1
    return env, words[start:]


def test_gpu_test_step_selects_each_backends_gpu_tests(plan: dict[str, str]) -> None:
    _, args = _pytest_args(plan["gpu-tests"])
    result = _run([sys.executable, "-m", "pytest", *args, "--collect-only"], timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    for path in ("attention_triton/tests/test_triton_gpu.py",
                 "attention_triton/tests/test_triton_cuda_compile.py",
                 "attention_flashinfer/tests/test_flashinfer_gpu.py",
                 "attention_fa3/tests/test_fa3_gpu.py"):
        assert any(path in line for line in collected), f"no gpu test from {path}"


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_identity_step_collects_the_transformers_tests(plan: dict[str, str], backend: str) -> None:
    env, args = _pytest_args(plan[f"identity-{backend}"])
    assert env == {"PLUGSERVE_DEVICE": "cuda", "PLUGSERVE_ATTENTION": backend}
    assert all((ROOT / a).exists() for a in args if a.endswith(".py"))
    result = _run([sys.executable, "-m", "pytest", *args, "--collect-only"])
    assert result.returncode == 0, result.stdout[-2000:]
    assert sum("::" in line for line in result.stdout.splitlines()) >= 10


def test_conformance_steps_name_registered_backends(plan: dict[str, str]) -> None:
    listed = _run([str(VENV_BIN / "plugserve"), "plugins", "--json"])
    assert listed.returncode == 0, listed.stderr
    registered = json.dumps(json.loads(listed.stdout))
    for backend in ("triton", "flashinfer", "fa3"):
        words = shlex.split(plan[f"conformance-{backend}"])
        assert words[1:5] == ["conformance", "--attention", backend, "--device"]
        assert f'"{backend}"' in registered
        # The same command line, collecting only: it parses and finds the suite here.
        result = _run([*words, "--collect-only"])
        assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-1500:]
        assert "tests collected" in result.stdout


def test_bench_steps_parse_up_to_the_device_check(plan: dict[str, str]) -> None:
    words = shlex.split(plan["bench-triton"].split(">")[0])
    result = _run(words)
    assert result.returncode == 1
    assert "device 'cuda' was requested" in result.stderr + result.stdout


def test_bench_line_reads_a_real_bench_document(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = _run([str(VENV_BIN / "plugserve"), "bench", "throughput", "--num-seqs", "2",
                   "--max-input-len", "16", "--max-output-len", "16", "--page-size", "16",
                   "--json"], timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out.write_text(result.stdout)
    line = _run([sys.executable, str(ROOT / "scripts" / "bench_line.py"), str(out)])
    assert line.returncode == 0, line.stderr
    assert line.stdout.startswith("torch_native float32 page 16: plugserve ")
    assert "output tok/s, TTFT median" in line.stdout


def test_runner_reports_each_step_and_fails_on_any_failure(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.tsv"
    plan_file.write_text("# a comment\nok\techo 3 passed\nbad\techo boom; exit 3\n"
                         "slow\tsleep 20\n")
    env = {"GPU_CHECK_LOGS": str(tmp_path / "logs"), "GPU_CHECK_STEP_TIMEOUT": "2"}
    result = _run([str(SCRIPT), "--plan", str(plan_file)], env=env)
    assert result.returncode == 1
    table = result.stdout.split("step ", 1)[1]
    assert [line.split()[:2] for line in table.splitlines()[2:5]] == [
        ["ok", "PASS"], ["bad", "FAIL"], ["slow", "TIMEOUT"]]
    assert "boom" in table and "3 passed" in table
    assert "2 of 3 steps failed" in result.stdout
    assert (tmp_path / "logs" / "bad.log").read_text() == "boom\n"
    only = _run([str(SCRIPT), "--plan", str(plan_file), "--only", "ok"], env=env)
    assert only.returncode == 0 and "all 1 steps passed" in only.stdout
    unknown = _run([str(SCRIPT), "--only", "nosuchstep", "--dry-run"])
    assert unknown.returncode == 2 and "no step starts with" in unknown.stderr


def test_make_target_calls_the_script() -> None:
    result = _run(["make", "-n", "gpu-check", "GPU_CHECK_ARGS=--dry-run"])
    assert result.returncode == 0
    assert "./scripts/gpu_check.sh --dry-run" in result.stdout
