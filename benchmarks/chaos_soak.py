"""Chaos soak: many requests, misbehaving clients included, against one live `plugserve
serve` on loopback with the KV checker at level 1 (and physical page checks) the whole time.

    python benchmarks/chaos_soak.py [--requests 2000] [--concurrency 32] [--model M|tiny]
        [--runs plain,eagle,overlap] [--kv-pool-tokens 1536] [--max-waiting 24] [--json]

Each run (`plain`, `eagle`: `--spec eagle`, `overlap`: `--overlap`) starts its own server with a
KV pool small enough to force retracts and a small waiting queue (a 503 is allowed), then sends
the requests from the client workers: streaming and not, completions and chat, greedy and
sampled, stop strings; ~10% disconnect at a random point, ~5% are bad requests (each must get
its expected 4xx). Reported per run: served, 503s, 4xx by kind, 5xx and protocol violations
(both must be 0), retracts, leaks (the checker never fired, KV balance 0, memory whole at
idle), server RSS before (after a warm-up) and after; exit code 1 when a run broke a rule.
`--model tiny` builds the tiny random test model (and trains a tiny EAGLE head for it);
without --model the server runs the default SmolLM2-135M, whose EAGLE head ships with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = "the a cat dog runs over under river mountain blue green quickly slowly why how".split()
RUN_ARGS = {"plain": [], "eagle": ["--spec", "eagle"], "overlap": ["--overlap"]}


@dataclass
class Tally:
    served: int = 0
    streamed: int = 0
    disconnects: int = 0
    overloaded: int = 0
    client_errors: Counter[str] = field(default_factory=Counter)
    server_errors: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        return {name: dict(v) if isinstance(v, Counter) else v for name, v in vars(self).items()}


def bad_requests(model: str, context: int) -> list[tuple[str, Any, int]]:
    """(kind, body: dict = JSON / str = raw, expected status)."""
    return [
        ("malformed JSON", '{"prompt": "x", ', 400), ("n=0", {"prompt": "x", "n": 0}, 400),
        ("top_p 0", {"prompt": "x", "top_p": 0}, 400),
        ("negative max_tokens", {"prompt": "x", "max_tokens": -3}, 400),
        ("temperature as text", {"prompt": "x", "temperature": "hot"}, 400),
        ("unknown field", {"prompt": "x", "best_effort": True}, 400),
        ("unknown model", {"model": "nope", "prompt": "x"}, 404),
        ("prompt over the context", {"model": model, "prompt": [5] * (context + 8)}, 413),
        ("huge body", {"prompt": "x" * (3 << 20)}, 413),
        ("empty prompt", {"prompt": ""}, 400),
    ]


def good_body(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
    body: dict[str, Any] = {
        "model": model, "max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5,
        "temperature": rng.choice([0.0, 0.0, 0.7]), "seed": rng.randrange(1 << 30),
        "ignore_eos": rng.random() < 0.5, "return_token_ids": True,
    }
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}
    return "/v1/completions", {**body, "prompt": words}


async def send_good(client: httpx.AsyncClient, path: str, body: dict[str, Any], tally: Tally,
                    drop_after: int | None) -> None:
    """One request; `drop_after`: disconnect after that many chunks (a plain request: after
    that many quarter seconds)."""
    limit = body["max_tokens"]
    if not body["stream"]:
        try:
            coro = client.post(path, json=body)
            r = await (asyncio.wait_for(coro, drop_after / 4) if drop_after is not None
                       else coro)
        except TimeoutError:
            tally.disconnects += 1
            return
        if check_status(r.status_code, r.text, tally):
            usage, choice = r.json()["usage"], r.json()["choices"][0]
            if not 1 <= usage["completion_tokens"] <= limit or \
                    choice["finish_reason"] not in ("stop", "length"):
                tally.violations.append(f"bad answer {usage} {choice['finish_reason']}")
            tally.served += 1
        return
    async with client.stream("POST", path, json=body) as r:
        if not check_status(r.status_code, (await r.aread()).decode() if r.status_code != 200
                            else "", tally):
            return
        chunks, tokens, usage, done = 0, 0, None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            doc = json.loads(line[6:])
            if "error" in doc:
                tally.violations.append(f"error in stream: {doc['error']['message']}")
                return
            tokens += sum(len(c.get("token_ids") or []) for c in doc["choices"])
            usage = doc.get("usage") or usage
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                tally.disconnects += 1
                return
        if not done or usage is None or usage["completion_tokens"] != tokens or tokens > limit:
            tally.violations.append(f"bad stream: done={done} usage={usage} tokens={tokens}")
        tally.served += 1
        tally.streamed += 1


def check_status(status: int, text: str, tally: Tally) -> bool:
    if status == 200:
        return True
    if status == 503:
        tally.overloaded += 1
    elif status >= 500:
        tally.server_errors[f"{status}: {text[:120]}"] += 1
    else:
        tally.violations.append(f"unexpected {status} for a good request: {text[:160]}")
    return False


async def soak(base_url: str, requests: int, concurrency: int, seed: int = 0,
               max_tokens: int = 48) -> Tally:
    """Send `requests` requests from `concurrency` workers; count what came back."""
    tally = Tally()
    rng = random.Random(seed)
    # Idle connections expire before uvicorn's 5 s keep-alive closes them under our feet.
    limits = httpx.Limits(max_connections=concurrency, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        bad = bad_requests(card["id"], card["max_model_len"])
        plan = [(rng.random(), random.Random(rng.randrange(1 << 30))) for _ in range(requests)]
        queue: asyncio.Queue[tuple[float, random.Random]] = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)

        async def worker() -> None:
            while not queue.empty():
                roll, r = queue.get_nowait()
                if roll < 0.05:
                    kind, body, want = r.choice(bad)
                    resp = await (client.post("/v1/completions", content=body,
                                              headers={"content-type": "application/json"})
                                  if isinstance(body, str) else
                                  client.post("/v1/completions", json=body))
                    if resp.status_code != want or "error" not in resp.json():
                        tally.violations.append(f"{kind}: {resp.status_code} {resp.text[:160]}")
                    tally.client_errors[f"{resp.status_code} {kind}"] += 1
                    continue
                path, body = good_body(r, card["id"], max_tokens)
                drop = r.randint(0, 8) if roll < 0.15 else None
                try:
                    await send_good(client, path, body, tally, drop)
                except httpx.HTTPError as exc:
                    tally.violations.append(f"transport: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def live_server(args: list[str], threads: int | None) -> Any:
    """`python -m plugserve serve ARGS` on a free loopback port, stopped with SIGINT: yields
    the URL, the process and its stderr (a temporary file the caller closes)."""
    port = free_port()
    env = {**os.environ, "PLUGSERVE_MEM_CHECK": "1", "PLUGSERVE_CHECK_PAGES": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log = tempfile.TemporaryFile("w+")  # the server's stderr (a pipe nobody reads could fill)
    proc = subprocess.Popen([sys.executable, "-m", "plugserve", "serve", "--port", str(port),
                             *args], env=env, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited: {log.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 300 s")
            time.sleep(0.3)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(2)  # SIGINT: graceful
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def idle_figures(url: str) -> dict[str, Any]:
    """Wait until nothing runs or waits, then the health and metrics that prove no leak."""
    deadline = time.monotonic() + 120
    while True:
        health = httpx.get(url + "/health", timeout=10).json()
        if (health["running"] == 0 and health["waiting"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # let the engine settle its idle check
    health = httpx.get(url + "/health", timeout=10).json()
    metrics = httpx.get(url + "/metrics", timeout=10).text

    def value(name: str) -> float:
        found = re.search(re.escape(name) + r" ([-0-9.e+]+)", metrics)
        return float(found.group(1)) if found else float("nan")

    return {"health": health, "kv_balance": value('plugserve_kv_balance_slots{pool="full"}'),
            "retracted": value('plugserve_engine_stat{stat="retracted_reqs"}'),
            "checker_steps": value("plugserve_checker_steps_checked"),
            "aborted": value('plugserve_requests_total{outcome="abort"}')}


def run_config(name: str, model_args: list[str], requests: int, concurrency: int,
               kv_pool_tokens: int, max_tokens: int = 48, seed: int = 0,
               threads: int | None = None, max_waiting: int = 24) -> dict[str, Any]:
    """One server, one soak; the report of the run (`ok` says whether every rule held)."""
    args = [*model_args, "--kv-pool-tokens", str(kv_pool_tokens), "--max-waiting",
            str(max_waiting), *RUN_ARGS[name]]
    t0 = time.perf_counter()
    with live_server(args, threads) as (url, proc, log):
        asyncio.run(soak(url, min(8, requests), 4, seed + 1, max_tokens))  # warm-up
        idle_figures(url)
        before = rss_mib(proc.pid)
        tally = asyncio.run(soak(url, requests, concurrency, seed, max_tokens))
        figures = idle_figures(url)
        after = rss_mib(proc.pid)
    health = figures["health"]
    leaks = int(health["engine_error"] is not None) + int(figures["kv_balance"] != 0)
    report = {"run": name, "requests": requests, "concurrency": concurrency,
              "kv_pool_tokens": kv_pool_tokens, "seconds": time.perf_counter() - t0,
              **tally.document(), "retracted": figures["retracted"], "aborted": figures["aborted"],
              "checker_steps": figures["checker_steps"], "leaks": leaks,
              "memory_whole_at_idle": health["memory_whole_at_idle"],
              "rss_mib_before": round(before, 1), "rss_mib_after": round(after, 1),
              "server_exit_code": proc.returncode}
    log.seek(0)
    report["server_log_tail"] = log.read()[-1500:]
    log.close()
    report["ok"] = (not tally.server_errors and not tally.violations and leaks == 0
                    and health["memory_whole_at_idle"] and proc.returncode == 0)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", help="HF folder / .gguf, or 'tiny'; default: SmolLM2-135M")
    ap.add_argument("--runs", default="plain,eagle,overlap")
    ap.add_argument("--kv-pool-tokens", type=int, default=1536)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-waiting", type=int, default=24, help="the server's queue limit")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the server")
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args()
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        model_args = ["--model", opts.model] if opts.model and opts.model != "tiny" else []
        head: list[str] = []
        if opts.model == "tiny":
            from plugserve.testing.tiny_models import make_tiny_model_dir

            target = make_tiny_model_dir(Path(tmp) / "tiny")
            model_args = ["--model", str(target)]
            if "eagle" in opts.runs:
                from plugserve_spec_eagle.testing import make_tiny_head_dir

                head = ["--draft-model", str(make_tiny_head_dir(target, Path(tmp) / "head",
                                                                trained=True))]
        for name in opts.runs.split(","):
            extra = head if name == "eagle" else []
            report = run_config(name, model_args + extra, opts.requests, opts.concurrency,
                                opts.kv_pool_tokens, opts.max_tokens, threads=opts.threads,
                                max_waiting=opts.max_waiting)
            reports.append(report)
            if not opts.json:
                print(json.dumps({k: v for k, v in report.items() if k != "violations"},
                                 default=str), file=sys.stderr)
                for line in report["violations"][:10]:
                    print(f"  violation: {line}", file=sys.stderr)
    if opts.json:
        print(json.dumps(reports, indent=2, default=str))
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
