"""Run `plugserve bench latency`'s request through llama.cpp (`--compare llamacpp`).

This script runs under the llama.cpp environment's interpreter (`--llamacpp-python`, e.g.
`.venv-llamacpp/bin/python` from `benchmarks/setup_llamacpp.sh`), never under plugserve's:
it imports only the standard library, numpy and `llama_cpp` (llama-cpp-python). It reads
one JSON workload on stdin:

    {"model": GGUF file, "prompt": [token ids], "output_len": int, "n_threads": int,
     "n_ctx": int, "first_tokens": 32, "num_iters": int, "num_iters_warmup": int,
     "seed": 0}

and prints one JSON result on stdout:

    {"prompt_tokens", "output_tokens", "n_threads", "prefill_s": [per iteration],
     "decode_s": [...], "latency_s": [...], "prefill_tok_per_s", "decode_tok_per_s"
     (medians over the iterations), "load_seconds", "first_tokens": [the first greedy ids],
     "tokens_identical_across_iters", "llama_cpp_version", "system_info"}

Batch 1: one sequence. Greedy (the argmax of the last position's logits, taken here, so no
sampler chain runs), EOS ignored: exactly `output_len` tokens. Per iteration the context is
reset, the prompt is evaluated in one call (prefill, timed with its first token's argmax)
and then `output_len - 1` single-token evaluations follow (decode, timed together), as
`plugserve bench latency` times TTFT and (latency - TTFT). `n_threads` threads both for
the prompt and for decoding.

Everything llama.cpp writes goes to stderr: the result is the only thing on stdout. Exit
codes: 0 done, 3 llama_cpp is not importable here, 2 a bad workload document, 1 anything
else (the error on stderr's last line).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

# Python puts this script's folder first on sys.path; nothing of plugserve's may shadow the
# packages this script imports from the llama.cpp environment.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

EXIT_NO_LLAMA_CPP = 3
EXIT_BAD_INPUT = 2
WARMUP_PROMPT_LEN = 16
WARMUP_TOKENS = 8


def _result_stream() -> Any:
    """A private copy of stdout for the result; fd 1 (this process and llama.cpp's C code)
    now goes to stderr."""
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return result


def _fail(code: int, message: str) -> int:
    print(message.replace("\n", " "), file=sys.stderr, flush=True)
    return code


def check_workload(work: Any) -> str | None:
    """What is wrong with the workload document, or None."""
    if not isinstance(work, dict):
        return "the workload is not a JSON object"
    for key in ("model", "prompt", "output_len", "n_threads"):
        if key not in work:
            return f"the workload has no {key!r}"
    prompt = work["prompt"]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(t, int) and t >= 0 for t in prompt):
        return "'prompt' must be a non-empty list of token ids (integers >= 0)"
    for key, least in (("output_len", 1), ("n_threads", 1), ("num_iters", 1),
                       ("num_iters_warmup", 0)):
        value = work.get(key, least)
        if not isinstance(value, int) or value < least:
            return f"{key!r} must be an integer >= {least}, got {value!r}"
    if not os.path.isfile(str(work["model"])):
        return f"the model {work['model']!r} is not a file"
    return None


class GreedyRunner:
    """One llama.cpp context; `run` times one prefill + decode of the prompt."""

    def __init__(self, work: dict[str, Any]) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        prompt_len, output_len = len(work["prompt"]), int(work["output_len"])
        n_ctx = int(work.get("n_ctx") or 0)
        n_ctx = max(n_ctx, prompt_len + output_len, WARMUP_PROMPT_LEN + WARMUP_TOKENS)
        threads = int(work["n_threads"])
        start = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=str(work["model"]), n_ctx=n_ctx, n_batch=max(prompt_len, 32),
            n_ubatch=min(max(prompt_len, 32), 512), n_threads=threads,
            n_threads_batch=threads, seed=int(work.get("seed", 0)), logits_all=False,
            verbose=False,
        )
        self.load_seconds = time.perf_counter() - start
        self.n_vocab = int(self.llm.n_vocab())

    def argmax_last(self) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1),
                                       shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def run(self, prompt: list[int], output_len: int) -> tuple[float, float, list[int]]:
        """(prefill seconds, decode seconds, the greedy tokens)."""
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        tokens = [self.argmax_last()]
        prefilled = time.perf_counter()
        for _ in range(output_len - 1):
            llm.eval([tokens[-1]])
            tokens.append(self.argmax_last())
        done = time.perf_counter()
        return prefilled - start, done - prefilled, tokens


def run(work: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    prompt = [int(t) for t in work["prompt"]]
    output_len = int(work["output_len"])
    runner = GreedyRunner(work)
    if max(prompt) >= runner.n_vocab:
        raise ValueError(f"prompt token id {max(prompt)} is outside the model's vocabulary "
                         f"of {runner.n_vocab}")
    runner.run(prompt[:WARMUP_PROMPT_LEN], WARMUP_TOKENS)
    for _ in range(int(work.get("num_iters_warmup", 1))):
        runner.run(prompt, output_len)
    prefill_s: list[float] = []
    decode_s: list[float] = []
    outputs: list[list[int]] = []
    for _ in range(int(work.get("num_iters", 1))):
        prefill, decode, tokens = runner.run(prompt, output_len)
        prefill_s.append(prefill)
        decode_s.append(decode)
        outputs.append(tokens)
    prefill_rates = [len(prompt) / s for s in prefill_s if s > 0]
    decode_rates = [(output_len - 1) / s for s in decode_s if s > 0 and output_len > 1]
    first = int(work.get("first_tokens", 32))
    return {
        "prompt_tokens": len(prompt),
        "output_tokens": output_len,
        "n_threads": int(work["n_threads"]),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "latency_s": [p + d for p, d in zip(prefill_s, decode_s, strict=True)],
        "prefill_tok_per_s": statistics.median(prefill_rates) if prefill_rates else None,
        "decode_tok_per_s": statistics.median(decode_rates) if decode_rates else None,
        "load_seconds": runner.load_seconds,
        "first_tokens": outputs[0][:first],
        "tokens_identical_across_iters": all(o == outputs[0] for o in outputs),
        "llama_cpp_version": str(getattr(llama_cpp, "__version__", "unknown")),
        "system_info": _system_info(llama_cpp),
    }


def _system_info(llama_cpp: Any) -> str:
    info = llama_cpp.llama_print_system_info()
    return (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip()


def main() -> int:
    result_out = _result_stream()
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:
        return _fail(EXIT_NO_LLAMA_CPP, f"llama_cpp is not importable by {sys.executable}: "
                                        f"{type(exc).__name__}: {exc}")
    try:
        work = json.load(sys.stdin)
    except ValueError as exc:
        return _fail(EXIT_BAD_INPUT, f"the workload on stdin is not JSON: {exc}")
    problem = check_workload(work)
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
