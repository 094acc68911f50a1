"""`bench latency --compare llamacpp`: the same GGUF file and prompt through llama.cpp.

llama.cpp is never installed next to plugserve: `benchmarks/setup_llamacpp.sh` makes
`.venv-llamacpp` (llama-cpp-python built for this CPU) and `--llamacpp-python
.venv-llamacpp/bin/python` names its interpreter. The script `llamacpp_driver.py` (beside
this file) runs under it: it reads the workload as JSON on stdin (the GGUF file, the first
prompt of the engine's batch, the output length, the thread count, the iterations) and
prints its timings and first greedy tokens as JSON.

Same file, same threads (torch's thread count in this process is llama.cpp's `n_threads`
and `n_threads_batch`), same prompt ids, greedy, EOS ignored, the same iteration counts.
llama.cpp runs batch 1 (one sequence) whatever `--batch-size` the engine ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugserve.bench.foreign_python import check_interpreter, run_driver

DRIVER = Path(__file__).with_name("llamacpp_driver.py")
SETUP_HINT = ("run benchmarks/setup_llamacpp.sh (it creates .venv-llamacpp) and pass "
              "--llamacpp-python .venv-llamacpp/bin/python")
FIRST_TOKENS = 32


class LlamaCppError(RuntimeError):
    """`--compare llamacpp` cannot run or failed: one line naming the interpreter and what
    to do."""


def gguf_file_of(model: str | Path | None) -> Path:
    """The GGUF file both sides run: `--model` when it is one, the built-in default model's
    file when no model is given; an HF folder is refused (llama.cpp reads only GGUF)."""
    if model is None:
        from plugserve.model.default_model import default_gguf_path

        return default_gguf_path()
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf":
        raise LlamaCppError(f"--compare llamacpp runs the same GGUF file on both sides; "
                            f"--model {str(model)!r} is not a .gguf file")
    if not path.is_file():
        raise LlamaCppError(f"--model {str(model)!r}: no such file")
    return path


@dataclass(frozen=True)
class LlamaCppComparison:
    """`--compare llamacpp --llamacpp-python PATH`."""

    python: Path
    first_tokens: int = FIRST_TOKENS
    timeout_s: float | None = None

    def check(self, device: str) -> None:
        """Before any engine starts: the device, the interpreter, llama_cpp there."""
        if not device.startswith("cpu"):
            raise LlamaCppError(f"--compare llamacpp runs llama.cpp on the CPU; plugserve "
                                f"would run on {device!r}: compare with --device cpu")
        check_interpreter(self.python, flag="--llamacpp-python", module="llama_cpp",
                          package="llama_cpp (llama-cpp-python)", setup_hint=SETUP_HINT,
                          error=LlamaCppError)

    def run(self, model: Path, prompt: list[int], output_len: int, n_threads: int,
            num_iters: int, num_iters_warmup: int) -> dict[str, Any]:
        work = {
            "model": str(model), "prompt": [int(t) for t in prompt], "output_len": output_len,
            "n_threads": n_threads, "n_ctx": len(prompt) + output_len,
            "first_tokens": self.first_tokens, "num_iters": num_iters,
            "num_iters_warmup": num_iters_warmup, "seed": 0,
        }
        result = self.call_driver(work)
        result.update(python=str(self.python), model=str(model), batch_size=1)
        return result

    def call_driver(self, work: dict[str, Any]) -> dict[str, Any]:
        """Run llamacpp_driver.py under the interpreter; its log goes to a file kept on
        failure."""
        return run_driver(self.python, DRIVER, work, name="llama.cpp",
                          flag="--llamacpp-python", module="llama_cpp",
                          result_key="decode_tok_per_s", setup_hint=SETUP_HINT,
                          error=LlamaCppError, timeout_s=self.timeout_s)
