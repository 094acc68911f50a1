"""The multi-machine path on one machine: two `torchrun --nnodes 2` launches (c10d rendezvous
on 127.0.0.1) run `plugserve serve --tp 2`; whichever becomes rank 0 serves HTTP, the other
follows. A completion comes back token-identical to one rank's engine, and Ctrl-C stops both
launches and their ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams

from .procs import descendants, wait_gone

PROMPT = [17, 33, 80, 120, 4, 9, 250, 61]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_two_torchrun_launches_serve_a_request(
    tp_models: Callable[[str], Path], session_process: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    import httpx

    model = str(tp_models("llama"))
    rendezvous, http_port = _free_port(), _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` command
    launches = []
    for node in range(2):
        with (tmp_path / f"node{node}.log").open("wb") as log:  # the launch keeps its copy
            launches.append(session_process(
                [*torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{rendezvous}", "--rdzv-id", f"tp-{rendezvous}",
                 "-m", "plugserve", "serve", "--tp", "2", "--model", model,
                 "--port", str(http_port), "--mem-check", "1", "--check-pages"],
                stdout=log, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1"}))
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 180.0
    while True:
        assert all(p.poll() is None for p in launches), _logs(tmp_path)
        assert time.monotonic() < deadline, "the server did not come up\n" + _logs(tmp_path)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    reply = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    got = reply.json()["choices"][0]["token_ids"]
    with Engine(model=model) as one_rank:
        (expected,) = one_rank.generate([PROMPT], SamplingParams(max_new_tokens=12))
    assert got == expected.token_ids
    ranks = set().union(*(descendants(p.pid) for p in launches)) | {p.pid for p in launches}
    for launch in launches:
        os.killpg(launch.pid, signal.SIGINT)  # Ctrl-C in each terminal
    assert not wait_gone(ranks, timeout_s=60.0), "a launch or rank outlived Ctrl-C"


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(folder.glob("node*.log")))
