"""`plugserve serve --engine-process --tp 2`: the engine process is rank 0 and starts rank 1
itself. Greedy tokens over HTTP equal TP=1's in this process; a rank killed with SIGKILL turns
/health into a 503 naming it (the rank problem comes over with the engine's step messages);
SIGTERM then stops the server with nothing left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams

from .procs import _cmdline, descendants, in_group, wait_gone

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 12]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_engine_process_is_rank_0(tp_models: Callable[[str], Path],
                                  session_process: Callable[..., subprocess.Popen[bytes]]
                                  ) -> None:
    model = tp_models("llama")
    with Engine(model=str(model)) as engine:
        expected = engine.generate([PROMPT], SamplingParams(max_new_tokens=8,
                                                            ignore_eos=True))[0].token_ids
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = session_process([sys.executable, "-m", "plugserve", "serve", "--engine-process",
                            "--tp", "2", "--model", str(model), "--port", str(port)],
                           stderr=subprocess.PIPE)
    deadline = time.monotonic() + 900
    while True:
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.5)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    out = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == list(expected)
    children = {int(p) for p in os.listdir("/proc") if p.isdigit()} & descendants(proc.pid)
    ranks = [p for p in children if p not in _direct_children(proc.pid)]
    assert len(ranks) == 1, (children, ranks)  # rank 1, a child of the engine process
    os.kill(ranks[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (health := httpx.get(url + "/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "/health kept answering 200"
        time.sleep(0.1)
    assert health.status_code == 503
    assert "rank 1" in (health.json()["rank_problem"] or health.json()["engine_error"] or "")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, "a rank died: the command reports the failure"
    # The engine process and rank 1's helpers end with the server (the engine process stops
    # itself once the server is gone; Python's resource tracker once its pipe closes).
    left = wait_gone(in_group(proc.pid), timeout_s=15.0)
    assert not left, ([(p, _cmdline(p)) for p in left], err.decode()[-3000:])


def _direct_children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(text[text.rindex(")") + 2:].split()[1]) == pid:
                out.add(int(entry))
    return out
