"""`plugserve bench latency` on tiny models, and `--compare llamacpp` without llama.cpp.

The "llama.cpp interpreter" in these tests is a test double: a shell script that runs this
environment's Python with a fake `llama_cpp` package first on the path. Its `Llama.eval`
makes the next argmax a token it was told to replay (or a fixed function of the last
token), records what it received, and can fail on request. The real driver script
(core/bench/llamacpp_driver.py) runs under it, so the JSON protocol, the greedy loop and the
error messages are the real ones; the figures are not llama.cpp's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFReader

from plugserve.bench.latency import LatencyOptions, make_prompts
from plugserve.bench.llamacpp import DRIVER, SETUP_HINT
from plugserve.testing.reference import hf_greedy

ENV = {"PLUGSERVE_PLUGINS": "checker"}

FAKE_LLAMA_CPP = '''
"""A test double for llama-cpp-python: FAKE_LLAMA_* variables steer it."""
import ctypes, json, os
import numpy as np

__version__ = "0.0.fake"
print("fake llama_cpp: noise on stdout that must not reach the result")
_LAST = None


class Llama:
    def __init__(self, model_path, **kwargs):
        global _LAST
        if os.environ.get("FAKE_LLAMA_FAIL"):
            raise RuntimeError("fake llama.cpp failed to load the model")
        self.model_path, self.kwargs = model_path, kwargs
        self.vocab = int(os.environ.get("FAKE_LLAMA_VOCAB", "256"))
        self.ctx = object()
        self.n_tokens = self.generated = 0
        self.logits = np.zeros(self.vocab, dtype=np.float32)
        replay = os.environ.get("FAKE_LLAMA_TOKENS")
        self.replay = json.loads(open(replay).read()) if replay else None
        _LAST = self

    def n_vocab(self):
        return self.vocab

    def reset(self):
        self.n_tokens = self.generated = 0

    def eval(self, tokens):
        self.n_tokens += len(tokens)
        if self.replay is not None:
            nxt = self.replay[min(self.generated, len(self.replay) - 1)]
        else:
            nxt = (int(tokens[-1]) * 7 + 3) % self.vocab
        self.generated += 1
        self.logits[:] = 0.0
        self.logits[nxt] = 1.0
        record = os.environ.get("FAKE_LLAMA_RECORD")
        if record and len(tokens) > 1:  # a prompt: the last one is the timed prompt
            with open(record, "w") as f:
                json.dump({"model": self.model_path, "kwargs": self.kwargs,
                           "prompt": [int(t) for t in tokens]}, f)


def llama_get_logits_ith(ctx, i):
    assert i == -1
    return _LAST.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def llama_print_system_info():
    return b"AVX = 1 | fake = 1"
'''


def make_interpreter(folder: Path, with_llama_cpp: bool = True) -> Path:
    """An executable that runs this Python, with the fake llama_cpp importable when asked."""
    folder.mkdir(parents=True, exist_ok=True)
    path_line = ""
    if with_llama_cpp:
        package = folder / "site" / "llama_cpp"
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(FAKE_LLAMA_CPP)
        path_line = (f'PYTHONPATH="{folder / "site"}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
                     "export PYTHONPATH\n")
    python = folder / "bin" / "python"
    python.parent.mkdir(exist_ok=True)
    python.write_text(f'#!/bin/sh\n{path_line}exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture(autouse=True)
def _clean_fake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import plugserve.bench.bandwidth

    # The probe's buffer, 1 GiB by default, is seconds of work per reading on a busy machine.
    monkeypatch.setattr(plugserve.bench.bandwidth, "BANDWIDTH_MIB", 64)
    for name in ("FAKE_LLAMA_FAIL", "FAKE_LLAMA_TOKENS", "FAKE_LLAMA_RECORD",
                 "FAKE_LLAMA_VOCAB"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama written as an F32 GGUF file (llama.cpp's layout)."""
    from tests.model.conftest import tiny_hf_model, write_tiny_gguf

    folder = tmp_path_factory.mktemp("tiny_gguf")
    path = folder / "tiny.gguf"
    write_tiny_gguf(tiny_hf_model("llama", folder / "hf"), path)
    return path


# --- the workload ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("input_len", 0),
                                         ("output_len", 1), ("num_iters", 0),
                                         ("num_iters_warmup", -1)])
def test_bad_options(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{field} must be >= "):
        LatencyOptions(**{field: value})


def test_prompts_are_seeded_and_inside_the_vocabulary() -> None:
    options = LatencyOptions(batch_size=3, input_len=50, seed=4)
    prompts = make_prompts(options, vocab_size=40)
    assert prompts == make_prompts(options, vocab_size=40)
    assert [len(p) for p in prompts] == [50, 50, 50] and len({tuple(p) for p in prompts}) == 3
    assert max(max(p) for p in prompts) < 40
    assert make_prompts(LatencyOptions(seed=5), 40) != make_prompts(LatencyOptions(seed=4), 40)


LATENCY = ["bench", "latency", "--input-len", "12", "--output-len", "9", "--num-iters", "2",
           "--num-iters-warmup", "1", "--mem-check", "1"]


def test_bench_latency_json(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    run = cli(*LATENCY, "--model", str(tiny_model_dir), "--batch-size", "2", "--json",
              env=ENV)
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    work = report["workload"]
    assert (work["name"], work["batch_size"], work["input_len"], work["output_len"]) == (
        "latency", 2, 12, 9)
    assert work["threads"] == torch.get_num_threads()
    mine = report["latency"]["plugserve"]
    assert len(mine["latency_s"]) == len(mine["prefill_s"]) == len(mine["decode_s"]) == 2
    assert mine["avg_latency_s"] == pytest.approx(sum(mine["latency_s"]) / 2)
    for latency, prefill, decode in zip(mine["latency_s"], mine["prefill_s"],
                                        mine["decode_s"], strict=True):
        assert 0 < prefill < latency and 0 < decode < latency
        assert prefill + decode <= latency  # both inside the timed window
    rates = sorted(2 * 8 / d for d in mine["decode_s"])
    assert rates[0] <= mine["decode_tok_per_s"] <= rates[-1]
    assert set(mine["percentiles_s"]) == {"p10", "p25", "p50", "p75", "p90", "p99"}
    (engine_run,) = report["runs"]
    assert (engine_run["requests"], engine_run["output_tokens"]) == (2, 18)
    # Greedy, EOS ignored: the first sequence's tokens are transformers' for its prompt.
    assert mine["prompt"] == make_prompts(LatencyOptions(batch_size=2, input_len=12),
                                          vocab_size=len_vocab(tiny_model_dir))[0]
    assert mine["first_tokens"] == hf_greedy(tiny_model_dir, [mine["prompt"]], [9])[0]
    roofline = report["roofline"]
    assert roofline["source"] == "loaded weights"
    assert roofline["bytes_per_token"] == tiny_weight_bytes(tiny_model_dir)
    bandwidth = report["bandwidth"]
    assert len(bandwidth["read_gb_s_readings"]) == 2
    assert bandwidth["read_gb_s"] == max(bandwidth["read_gb_s_readings"])
    bound = bandwidth["read_gb_s"] * 1e9 / roofline["bytes_per_token"]
    assert roofline["plugserve"] == pytest.approx(mine["decode_tok_per_s"] / 2 / bound)
    assert "llamacpp" not in report


def len_vocab(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


def tiny_weight_bytes(folder: Path) -> int:
    """fp32 parameters read by one decode step of the tiny model (tied: the embedding once,
    as the LM head; untied: one embedding row plus the head)."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    total = sum(t.numel() * 4 for name, t in tensors.items())
    embed = tensors["model.embed_tokens.weight"]
    if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
        total -= tensors["lm_head.weight"].numel() * 4
    if not config.get("tie_word_embeddings"):
        total -= embed.numel() * 4 - embed.shape[1] * 4
    return total


def test_bench_latency_table(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    run = cli(*LATENCY, "--model", str(tiny_model_dir), env=ENV)
    assert run.exit_code == 0, run.stderr
    out = run.stdout
    assert "latency: batch 1, 12 prompt + 9 output tokens" in out
    assert "decode tok/s (median)" in out and "share of the roofline" in out
    assert "plugserve latency percentiles (s): p10" in out
    assert "MB per decode step from the loaded weights" in out


# --- the llama.cpp driver -------------------------------------------------------------------


def run_driver(python: Path, work: Any, env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
    import os

    text = work if isinstance(work, str) else json.dumps(work)
    return subprocess.run([str(python), str(DRIVER)], input=text, capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, **(env or {})})


def test_driver_greedy_loop_and_result(tmp_path: Path, tiny_gguf: Path) -> None:
    python = make_interpreter(tmp_path / "venv")
    record = tmp_path / "received.json"
    work = {"model": str(tiny_gguf), "prompt": [5, 6, 7, 8], "output_len": 40,
            "n_threads": 3, "num_iters": 2, "num_iters_warmup": 0}
    done = run_driver(python, work, {"FAKE_LLAMA_RECORD": str(record)})
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()  # the fake's own stdout went to stderr
    assert "noise on stdout" in done.stderr
    result = json.loads(line)
    expected, token = [], 8
    for _ in range(32):  # the fake's argmax: (last token * 7 + 3) % 256, fed back greedily
        token = (token * 7 + 3) % 256
        expected.append(token)
    assert result["first_tokens"] == expected
    assert result["tokens_identical_across_iters"] is True
    assert (result["prompt_tokens"], result["output_tokens"], result["n_threads"]) == (4, 40, 3)
    assert len(result["prefill_s"]) == len(result["decode_s"]) == 2
    decode_rates = sorted(39 / s for s in result["decode_s"])
    assert decode_rates[0] <= result["decode_tok_per_s"] <= decode_rates[-1]
    assert result["llama_cpp_version"] == "0.0.fake"
    assert result["system_info"] == "AVX = 1 | fake = 1"
    received = json.loads(record.read_text())
    assert received["prompt"] == [5, 6, 7, 8] and received["model"] == str(tiny_gguf)
    kwargs = received["kwargs"]
    assert (kwargs["n_threads"], kwargs["n_threads_batch"]) == (3, 3)
    assert kwargs["n_ctx"] >= 44 and kwargs["logits_all"] is False


@pytest.mark.parametrize("work,message", [
    ("not json", "the workload on stdin is not JSON"),
    ([1, 2], "bad workload: the workload is not a JSON object"),
    ({"prompt": [1], "output_len": 2, "n_threads": 1}, "bad workload: the workload has no "
     "'model'"),
    ({"model": "M", "prompt": [], "output_len": 2, "n_threads": 1},
     "bad workload: 'prompt' must be a non-empty list of token ids"),
    ({"model": "M", "prompt": [1, -2], "output_len": 2, "n_threads": 1},
     "bad workload: 'prompt' must be a non-empty list of token ids"),
    ({"model": "M", "prompt": [1], "output_len": 0, "n_threads": 1},
     "bad workload: 'output_len' must be an integer >= 1, got 0"),
    ({"model": "M", "prompt": [1], "output_len": 2, "n_threads": "2"},
     "bad workload: 'n_threads' must be an integer >= 1, got '2'"),
    ({"model": "/no/such.gguf", "prompt": [1], "output_len": 2, "n_threads": 1},
     "bad workload: the model '/no/such.gguf' is not a file"),
])
def test_driver_refuses_bad_workloads(tmp_path: Path, tiny_gguf: Path, work: Any,
                                      message: str) -> None:
    python = make_interpreter(tmp_path / "venv")
    if isinstance(work, dict) and work.get("model") == "M":
        work["model"] = str(tiny_gguf)
    done = run_driver(python, work)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr


def test_driver_prompt_outside_the_vocabulary(tmp_path: Path, tiny_gguf: Path) -> None:
    python = make_interpreter(tmp_path / "venv")
    work = {"model": str(tiny_gguf), "prompt": [1, 300], "output_len": 2, "n_threads": 1}
    done = run_driver(python, work)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: prompt token id 300 is outside the model's vocabulary of 256")


def test_driver_without_llama_cpp_says_so(tmp_path: Path) -> None:
    python = make_interpreter(tmp_path / "plain", with_llama_cpp=False)
    done = run_driver(python, "{}")
    assert done.returncode == 3 and done.stdout == ""
    assert "llama_cpp is not importable by " in done.stderr


# --- bench latency --compare llamacpp -------------------------------------------------------

COMPARE = ["bench", "latency", "--input-len", "20", "--output-len", "34", "--num-iters", "1",
           "--num-iters-warmup", "0", "--json"]


def test_compare_llamacpp_same_file_prompt_threads_and_agreement(
    cli: Callable[..., Any], tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    alone = cli(*COMPARE, "--model", str(tiny_gguf), env=ENV)
    assert alone.exit_code == 0, alone.stderr
    mine = json.loads(alone.stdout)["latency"]["plugserve"]
    assert len(mine["first_tokens"]) == 32
    # The stand-in replays the engine's greedy tokens with the sixth one changed.
    vocab = len_vocab(tiny_gguf.parent / "hf")
    monkeypatch.setenv("FAKE_LLAMA_VOCAB", str(vocab))
    replay = [*mine["first_tokens"], 0, 0]
    replay[5] = (replay[5] + 1) % vocab
    (tmp_path / "replay.json").write_text(json.dumps(replay))
    record = tmp_path / "received.json"
    monkeypatch.setenv("FAKE_LLAMA_TOKENS", str(tmp_path / "replay.json"))
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(record))
    python = make_interpreter(tmp_path / "venv")
    run = cli(*COMPARE, "--model", str(tiny_gguf), "--compare", "llamacpp",
              "--llamacpp-python", str(python), env=ENV)
    assert run.exit_code == 0, run.stderr
    report = json.loads(run.stdout)
    ours, theirs = report["latency"]["plugserve"], report["llamacpp"]
    assert ours["first_tokens"] == mine["first_tokens"]  # greedy: the same as alone
    assert theirs["first_tokens"] == replay[:32]
    agree = report["agreement"]
    assert (agree["compared"], agree["agree"], agree["common_prefix_mean"]) == (32, 31, 5)
    received = json.loads(record.read_text())
    assert received["prompt"] == ours["prompt"] and len(received["prompt"]) == 20
    assert received["model"] == str(tiny_gguf)
    threads = torch.get_num_threads()
    assert (received["kwargs"]["n_threads"], received["kwargs"]["n_threads_batch"]) == (
        threads, threads)
    assert theirs["batch_size"] == 1 and theirs["python"] == str(python)
    ratios = report["vs_llamacpp"]
    assert ratios["decode"] == pytest.approx(ours["decode_tok_per_s"]
                                             / theirs["decode_tok_per_s"])
    assert ratios["prefill"] == pytest.approx(ours["prefill_tok_per_s"]
                                              / theirs["prefill_tok_per_s"])
    roofline, bandwidth = report["roofline"], report["bandwidth"]
    assert roofline["source"] == "gguf tensors" and roofline["file"] == str(tiny_gguf)

    tensors = {t.name: t for t in GGUFReader(str(tiny_gguf)).tensors}
    embed = tensors["token_embd.weight"]  # untied: a step reads one row of it
    assert "output.weight" in tensors
    assert roofline["bytes_per_token"] == sum(int(t.n_bytes) for t in tensors.values()) - int(
        embed.n_bytes) + int(embed.n_bytes) // int(embed.shape[1])
    assert roofline["tensor_types"] == {"F32": len(tensors)}
    assert len(bandwidth["read_gb_s_readings"]) == 3  # before, after the engine, after llama.cpp
    bound = bandwidth["read_gb_s"] * 1e9 / roofline["bytes_per_token"]
    assert roofline["llamacpp"] == pytest.approx(theirs["decode_tok_per_s"] / bound)


def test_compare_llamacpp_table(cli: Callable[..., Any], tiny_gguf: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LLAMA_VOCAB", str(len_vocab(tiny_gguf.parent / "hf")))
    python = make_interpreter(tmp_path / "venv")
    run = cli("bench", "latency", "--input-len", "8", "--output-len", "6", "--num-iters", "1",
              "--batch-size", "2", "--model", str(tiny_gguf), "--compare", "llamacpp",
              "--llamacpp-python", str(python), env=ENV)
    assert run.exit_code == 0, run.stderr
    out = run.stdout
    assert "llama.cpp 0.0.fake (batch 1)" in out and "plugserve / llama.cpp" in out
    assert "llama.cpp ran batch 1; plugserve batch 2" in out
    assert "first 32 greedy tokens (plugserve request 0 / llama.cpp): " in out
    count = len(GGUFReader(str(tiny_gguf)).tensors)
    assert f"from the gguf tensors ({count} F32) at " in out


def test_driver_failure_is_one_line_with_its_log(
    cli: Callable[..., Any], tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    python = make_interpreter(tmp_path / "venv")
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    run = cli(*COMPARE, "--model", str(tiny_gguf), "--compare", "llamacpp",
              "--llamacpp-python", str(python), env=ENV)
    assert run.exit_code == 1
    (line,) = run.stderr_lines
    head = (f"error: the llama.cpp driver failed under {str(python)!r} (exit 1): "
            "RuntimeError: fake llama.cpp failed to load the model; its log: ")
    assert line.startswith(head), line
    log = Path(line.removeprefix(head))
    assert "Traceback" in log.read_text()
    log.unlink()


def error_cases(tmp: Path, tiny_model_dir: Path) -> dict[str, tuple[list[str], str]]:
    plain = make_interpreter(tmp / "plain", with_llama_cpp=False)
    fake = make_interpreter(tmp / "venv")
    gguf = tmp / "model.gguf"
    gguf.write_bytes(b"")
    missing = tmp / "missing" / "python"
    return {
        "no interpreter": (["--compare", "llamacpp"],
                           "error: --compare llamacpp needs --llamacpp-python PATH, an "
                           f"interpreter with llama-cpp-python: {SETUP_HINT}"),
        "interpreter without compare": (["--llamacpp-python", str(fake)],
                                        "error: --llamacpp-python applies only with --compare "
                                        "llamacpp"),
        "vllm on latency": (["--compare", "vllm", "--vllm-python", str(fake)],
                            "error: bench latency compares with llama.cpp only (--compare "
                            "llamacpp)"),
        "an HF folder": (["--model", str(tiny_model_dir), "--compare", "llamacpp",
                          "--llamacpp-python", str(fake)],
                         "error: --compare llamacpp runs the same GGUF file on both sides; "
                         f"--model {str(tiny_model_dir)!r} is not a .gguf file"),
        "no such interpreter": (["--compare", "llamacpp", "--llamacpp-python", str(missing)],
                                f"error: --llamacpp-python {str(missing)!r}: no such "
                                f"interpreter; {SETUP_HINT}"),
        "a folder": (["--compare", "llamacpp", "--llamacpp-python", str(tmp)],
                     f"error: --llamacpp-python {str(tmp)!r} is not an executable Python "
                     f"interpreter; {SETUP_HINT}"),
        "llama_cpp not installed": (["--compare", "llamacpp", "--llamacpp-python", str(plain)],
                                    "error: llama_cpp (llama-cpp-python) is not installed for "
                                    f"--llamacpp-python {str(plain)!r}; {SETUP_HINT}"),
        "a GPU": (["--compare", "llamacpp", "--llamacpp-python", str(fake), "--device",
                   "cuda"],
                  "error: --compare llamacpp runs llama.cpp on the CPU; plugserve would run "
                  "on 'cuda': compare with --device cpu"),
        "a throughput option": (["--max-input-len", "64"],
                                "error: --max-input-len does not apply to bench latency; its "
                                "options: --batch-size, --input-len, --output-len, "
                                "--num-iters, --num-iters-warmup, --seed"),
    }


@pytest.mark.parametrize("case", ["no interpreter", "interpreter without compare",
                                  "vllm on latency", "an HF folder", "no such interpreter",
                                  "a folder", "llama_cpp not installed", "a GPU",
                                  "a throughput option"])
def test_errors_come_before_any_engine(cli: Callable[..., Any], tmp_path: Path,
                                       tiny_model_dir: Path, case: str) -> None:
    args, expected = error_cases(tmp_path, tiny_model_dir)[case]
    model = [] if "--model" in args else ["--model", str(tmp_path / "model.gguf")]
    # model.gguf is an empty file: it would fail when the engine starts; these come first.
    run = cli("bench", "latency", *model, *args, env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1, run.stderr
    assert run.stderr_lines == [expected]


def test_compare_llamacpp_is_for_latency_only(cli: Callable[..., Any], tmp_path: Path) -> None:
    python = make_interpreter(tmp_path / "venv")
    run = cli("bench", "prefill", "--model", str(tmp_path / "no-model"), "--compare",
              "llamacpp", "--llamacpp-python", str(python), env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1
    assert run.stderr_lines == ["error: --compare llamacpp applies to bench latency, not prefill"]
