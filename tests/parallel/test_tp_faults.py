"""Faults and bad input at TP=2: each a clear error, in bounded time, nothing left behind.

A rank killed (kill -9) or stopped (a hang) mid-generation; the HTTP server's /health once a
rank died; SIGTERM to rank 0 and Ctrl-C to the whole group of `plugserve generate --tp 2`;
and at start-up, before any weight is read (the model folder's weights are garbage, so a read
would fail differently): a tp size the heads do not split into, larger than the head count, a
port in use, a world size that does not match, a backend without tensor parallelism.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import EngineStartError, EngineStoppedError
from plugserve.parallel import TensorParallelError, TensorParallelStartError
from plugserve.parallel.startup_checks import rank_problems
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts

from .procs import in_group, wait_gone

PROMPTS = random_prompts(4, 256, 5, 30, seed=3)
LONG = SamplingParams(max_new_tokens=300, ignore_eos=True)


def _child_pid(engine: Any) -> int:
    (process,) = engine.tp.children.processes
    return int(process.pid)


class TestRankFailures(EngineTest):
    def test_kill_9_mid_generation_names_the_rank(self, tp_models: Callable[[str], Path]
                                                  ) -> None:
        engine = self.engine(model=str(tp_models("llama")), tp_size=2)
        try:
            child = _child_pid(engine)
            events = 0
            killed_at = 0.0
            with pytest.raises(TensorParallelError) as caught:
                for _ in engine.stream(PROMPTS, LONG):
                    events += 1
                    if events == 20:
                        os.kill(child, signal.SIGKILL)
                        killed_at = time.monotonic()
            assert killed_at, "the generation was meant to be under way"
            assert time.monotonic() - killed_at < 30.0
            assert "tensor-parallel rank 1 killed by SIGKILL" in str(caught.value)
            assert engine.rank_problem() is not None
            with pytest.raises(EngineStoppedError, match="rank 1 killed by SIGKILL"):
                engine.submit(PROMPTS[0], LONG)
        finally:
            engine.close()

    def test_hung_rank_fails_after_the_collective_timeout(
        self, tp_models: Callable[[str], Path]
    ) -> None:
        engine = self.engine(model=str(tp_models("llama")), tp_size=2, tp_timeout_s=5)
        try:
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))  # kernels loaded
            child = _child_pid(engine)
            stopped_at = 0.0
            with pytest.raises(TensorParallelError) as caught:
                for events, _ in enumerate(engine.stream(PROMPTS, LONG)):
                    if events == 10:
                        os.kill(child, signal.SIGSTOP)
                        stopped_at = time.monotonic()
            assert stopped_at and time.monotonic() - stopped_at < 5 + 30
            assert "tensor-parallel rank 1 did not answer" in str(caught.value)
            # and the engine keeps saying which rank (what /health reports)
            problem = engine.rank_problem()
            assert problem is not None and "rank 1" in problem
            assert "tp_timeout_s=5" in str(caught.value)
        finally:
            engine.close()

    def test_health_answers_503_once_a_rank_died(self, tp_models: Callable[[str], Path]
                                                 ) -> None:
        import httpx

        from plugserve.server.background import BackgroundServer

        engine = self.engine(model=str(tp_models("llama")), tp_size=2)
        try:
            with BackgroundServer(engine) as server:
                assert httpx.get(server.url + "/health").status_code == 200
                os.kill(_child_pid(engine), signal.SIGKILL)
                deadline = time.monotonic() + 15.0
                while (health := httpx.get(server.url + "/health")).status_code == 200:
                    assert time.monotonic() < deadline, "/health kept answering 200"
                    time.sleep(0.1)
                assert health.status_code == 503
                assert "rank 1 killed by SIGKILL" in health.json()["rank_problem"]
        finally:
            engine.close()


def _plugserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "plugserve", *args]


@pytest.mark.parametrize("how", ["sigterm-rank0", "ctrl-c-group"])
def test_signals_stop_every_rank(how: str, tp_models: Callable[[str], Path],
                                 session_process: Callable[..., subprocess.Popen[bytes]]
                                 ) -> None:
    proc = session_process(
        _plugserve("generate", "hello there", "--tp", "2", "--model", str(tp_models("llama")),
                   "--max-new-tokens", "400"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120.0
    while len(in_group(proc.pid)) < 2:  # rank 0 and the rank it spawned
        assert proc.poll() is None, "plugserve generate ended before its ranks started"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    time.sleep(2.0)  # into start-up and generation
    if how == "sigterm-rank0":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    assert not wait_gone(in_group(proc.pid), timeout_s=20.0), "a rank outlived the signal"


class TestStartupRefusals(EngineTest):
    """Each refused before any weight is read: the folder's weights are not safetensors."""

    @pytest.fixture
    def no_weights(self, tp_models: Callable[[str], Path], tmp_path: Path) -> str:
        folder = tmp_path / "garbage_weights"
        shutil.copytree(tp_models("llama"), folder)
        (folder / "model.safetensors").write_bytes(b"not safetensors")
        return str(folder)

    def test_tp_that_does_not_divide_the_heads(self, no_weights: str) -> None:
        with pytest.raises(TensorParallelStartError) as caught:
            self.engine(model=no_weights, tp_size=3)
        assert "num_attention_heads (4) is not divisible by tp_size 3" in str(caught.value)
        assert "tp sizes this model can use: 1, 2, 4" in str(caught.value)

    def test_tp_larger_than_the_head_count(self, no_weights: str) -> None:
        with pytest.raises(TensorParallelStartError,
                           match="tp_size 8 is larger than the model's 4 attention heads"):
            self.engine(model=no_weights, tp_size=8)

    def test_port_in_use(self, no_weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            monkeypatch.setenv("MASTER_PORT", str(port))
            with pytest.raises(TensorParallelStartError,
                               match=f"MASTER_PORT={port} on 127.0.0.1 cannot be used"):
                self.engine(model=no_weights, tp_size=2)

    def test_world_size_that_does_not_match(self, no_weights: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_PORT", "29999")):
            monkeypatch.setenv(name, value)
        with pytest.raises(TensorParallelStartError,
                           match="world size mismatch: this rank was launched with "
                                 "WORLD_SIZE=3 but tp_size=2"):
            self.engine(model=no_weights, tp_size=2)

    @pytest.mark.integration  # names the triton plugin's backend
    def test_backend_without_tensor_parallel(self, no_weights: str) -> None:
        with pytest.raises(EngineStartError, match="does not support tensor parallelism "
                                                   r"\(tp_size=2\); backends that do: "):
            self.engine(model=no_weights, tp_size=2, attention="triton")


def test_ranks_started_differently_are_refused() -> None:
    def rank(r: int, device: str = "cpu", page: int = 1, world: int = 2) -> dict[str, Any]:
        return {"rank": r, "world_size": world, "device": device, "arch": {"heads": "4"},
                "config": {"page_size": page, "tp_size": world}}

    assert rank_problems([rank(0), rank(1)]) == []
    (mix,) = rank_problems([rank(0), rank(1, device="cuda")])
    assert "mix device types (rank 0 on cpu, rank 1 on cuda)" in mix
    (config,) = rank_problems([rank(0), rank(1, page=16)])
    assert "rank 1 was configured differently: page_size=16 (rank 0: 1)" in config
    problems = rank_problems([rank(0), rank(1, world=3)])
    assert any("world size mismatch: rank 1 expects 3 ranks, rank 0 expects 2" in p
               for p in problems)
