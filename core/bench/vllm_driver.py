"""Run one `plugserve bench` workload through vLLM's offline `LLM.generate` (`--compare vllm`).

This script runs under vLLM's interpreter (`--vllm-python`, e.g. `.venv-vllm/bin/python`
from `benchmarks/setup_vllm.sh`), never under plugserve's: it imports only the standard
library and vLLM. It reads one JSON workload on stdin:

    {"model": HF folder, "dtype": "float32" | "bfloat16" | "float16",
     "prompts": [[token ids], ...], "max_new": [int, ...], "first_tokens": 32,
     "max_model_len": int, "seed": 0, "rounds": [[[token ids], ...], ...] (optional)}

and prints one JSON result on stdout:

    {"requests", "prompt_tokens", "output_tokens", "seconds", "iteration_seconds",
     "output_tok_per_s",
     "prefill_seconds", "load_seconds", "first_tokens": [[the first greedy ids], ...],
     "vllm_version", "torch_version", "env": {VLLM_CPU_*, OMP_NUM_THREADS, LD_PRELOAD}}

Greedy (temperature 0), EOS ignored, exactly `max_new[i]` tokens per request, no
detokenization, all requests in one `generate` call (vLLM schedules them itself), after a
warm-up request. `prefill_seconds` times one more `generate` of every prompt with one output
token (prefix cache emptied first): the prefill of the whole workload. Each of `rounds`
(other prompts of the same lengths, `bench prefill --num-iters`) is timed after it the same
way; `seconds` is then the median of the timings (`iteration_seconds`, the first run's first).

Everything vLLM writes (its logs go to stdout by default, and so do its worker processes)
is sent to stderr: the result is the only thing on stdout. Exit codes: 0 done, 3 vLLM is
not importable here, 2 a bad workload document, 1 anything else (the error on stderr's last
line).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# Python puts this script's folder first on sys.path, and plugserve's `bench/vllm.py` lives
# there: without this, `import vllm` would find that module instead of vLLM.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

EXIT_NO_VLLM = 3
EXIT_BAD_INPUT = 2
WARMUP_PROMPT = list(range(100, 116))
WARMUP_TOKENS = 8


def _result_stream() -> Any:
    """A private copy of stdout for the result; fd 1 (this process and its children) now
    goes to stderr."""
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return result


def _fail(code: int, message: str) -> int:
    print(message.replace("\n", " "), file=sys.stderr, flush=True)
    return code


def _check_workload(work: Any) -> str | None:
    if not isinstance(work, dict):
        return "the workload is not a JSON object"
    for key in ("model", "prompts", "max_new"):
        if key not in work:
            return f"the workload has no {key!r}"
    prompts, max_new = work["prompts"], work["max_new"]
    if not isinstance(prompts, list) or not isinstance(max_new, list):
        return "'prompts' and 'max_new' must be lists"
    if len(prompts) != len(max_new) or not prompts:
        return f"{len(prompts)} prompts but {len(max_new)} output lengths"
    return None


def run(work: dict[str, Any]) -> dict[str, Any]:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    prompts: list[list[int]] = [[int(t) for t in p] for p in work["prompts"]]
    max_new: list[int] = [int(n) for n in work["max_new"]]
    first = int(work.get("first_tokens", 32))
    longest = max(len(p) + n for p, n in zip(prompts, max_new, strict=True))
    max_model_len = int(work.get("max_model_len") or longest)
    start = time.perf_counter()
    llm = LLM(
        model=str(work["model"]),
        dtype=str(work.get("dtype", "float32")),
        max_model_len=max(max_model_len, longest, len(WARMUP_PROMPT) + WARMUP_TOKENS),
        seed=int(work.get("seed", 0)),
        gpu_memory_utilization=float(work.get("gpu_memory_utilization", 0.5)),
        tensor_parallel_size=1,
    )
    load_seconds = time.perf_counter() - start

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                              detokenize=False)

    def token_prompts(ids: list[list[int]]) -> list[Any]:
        return [{"prompt_token_ids": p} for p in ids]

    llm.generate(token_prompts([WARMUP_PROMPT]), params(WARMUP_TOKENS), use_tqdm=False)
    llm.generate(token_prompts([WARMUP_PROMPT, WARMUP_PROMPT[:8]]), params(WARMUP_TOKENS),
                 use_tqdm=False)
    _reset_prefix_cache(llm)

    start = time.perf_counter()
    outputs = llm.generate(token_prompts(prompts), [params(n) for n in max_new], use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = [list(out.outputs[0].token_ids) for out in outputs]
    for i, (ids, n) in enumerate(zip(produced, max_new, strict=True)):
        if len(ids) != n:
            raise RuntimeError(f"vLLM produced {len(ids)} of {n} tokens for request {i}")

    _reset_prefix_cache(llm)
    start = time.perf_counter()
    llm.generate(token_prompts(prompts), params(1), use_tqdm=False)
    prefill_seconds = time.perf_counter() - start

    # Further timings on other prompts of the same lengths: the median of all is the figure.
    iteration_seconds = [seconds]
    for round_prompts in work.get("rounds") or []:
        _reset_prefix_cache(llm)
        start = time.perf_counter()
        llm.generate(token_prompts([[int(t) for t in p] for p in round_prompts]),
                     [params(n) for n in max_new], use_tqdm=False)
        iteration_seconds.append(time.perf_counter() - start)
    seconds = sorted(iteration_seconds)[(len(iteration_seconds) - 1) // 2]

    output_tokens = sum(len(ids) for ids in produced)
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": output_tokens,
        "seconds": seconds,
        "iteration_seconds": iteration_seconds,
        "output_tok_per_s": output_tokens / seconds if seconds > 0 else None,
        "prefill_seconds": prefill_seconds,
        "load_seconds": load_seconds,
        "first_tokens": [ids[:first] for ids in produced],
        "vllm_version": str(vllm.__version__),
        "torch_version": str(torch.__version__),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith("VLLM_CPU_") or k in ("OMP_NUM_THREADS", "LD_PRELOAD")},
    }


def _reset_prefix_cache(llm: Any) -> None:
    reset = getattr(llm, "reset_prefix_cache", None)
    if reset is not None:
        reset()


def main() -> int:
    result_out = _result_stream()
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return _fail(EXIT_NO_VLLM, f"vllm is not importable by {sys.executable}: "
                                   f"{type(exc).__name__}: {exc}")
    try:
        work = json.load(sys.stdin)
    except ValueError as exc:
        return _fail(EXIT_BAD_INPUT, f"the workload on stdin is not JSON: {exc}")
    problem = _check_workload(work)
    if problem is not None:
        return _fail(EXIT_BAD_INPUT, f"bad workload: {problem}")
    try:
        result = run(work)
    except Exception as exc:
        import traceback

        traceback.print_exc(file=sys.stderr)
        return _fail(1, f"{type(exc).__name__}: {exc}")
    json.dump(result, result_out)
    result_out.write("\n")
    result_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
