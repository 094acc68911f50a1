"""Greedy tokens at TP=2 (CPU, gloo, two ranks) equal TP=1 and transformers fp32.

Each case starts one two-rank engine with the checker at level 1 and physical page checks on
every rank (each rank's own checker, plus the cross-rank check of every pool's terms after
every step and at idle), runs the workload twice (the second round on a warm prefix cache),
and, for the session cases, a two-turn streaming session. The cases spread the matrix over
the tiny models (Llama, Qwen2, Qwen2 and Qwen3 hybrid sliding window, Qwen3 with its q/k
norms, Mistral, Gemma 3 with its 5:1 sliding-window layers): page sizes 1 and 16, radix and sessions, the normal and the overlap
loop, chunked prefill with a mixed chunk, and retracts on a small pool. Prompts and outputs
cross the models' 16-24-token windows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine
from plugserve.kernels import shm_all_reduce
from plugserve.parallel.runtime import RankMemory
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts

from .closeness import assert_greedy_close

VOCAB = 256


def _windows_workload() -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(3, VOCAB, 50, 90, seed=11)
    prompts.append(random_prompts(1, VOCAB, 6, 6, seed=12)[0])  # inside every window
    prompts.append([*prompts[0][:40], 5, 6, 7])  # shares a 40-token prefix with prompt 0
    return prompts, [40, 12, 30, 70, 24]


def _retract_workload() -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(6, VOCAB, 3, 40, seed=1)
    prompts.append([*prompts[0][:20], 7, 8, 9])
    return prompts, [n + 40 for n in (12, 5, 20, 9, 16, 1, 14)]


WORKLOADS = {"windows": _windows_workload, "retract": _retract_workload}


@functools.cache
def _reference(model_dir: Path, prompts: tuple[tuple[int, ...], ...],
               max_new: tuple[int, ...]) -> list[list[int]]:
    return hf_greedy(model_dir, [list(p) for p in prompts], list(max_new))


def reference(model_dir: Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    return _reference(model_dir, tuple(map(tuple, prompts)), tuple(max_new))


# (id, arch, workload, engine overrides, with a session)
CASES = [
    ("llama-page1-radix", "llama", "windows", {"page_size": 1}, False),
    ("llama-page16-overlap-mixed-sessions", "llama", "windows",
     {"page_size": 16, "overlap": True, "chunked_prefill_size": 16, "enable_mixed_chunk": True,
      "cache": "streaming_session"}, True),
    ("llama-page16-overlap-retract", "llama", "retract",
     {"page_size": 16, "overlap": True, "kv_pool_tokens": 128}, False),
    ("qwen2-page16-overlap-radix", "qwen2", "windows", {"page_size": 16, "overlap": True},
     False),
    ("qwen2_swa-page1-chunk16-sessions", "qwen2_swa", "windows",
     {"page_size": 1, "chunked_prefill_size": 16, "cache": "streaming_session"}, True),
    ("qwen2_swa-page16-overlap", "qwen2_swa", "windows", {"page_size": 16, "overlap": True},
     False),
    ("qwen3_swa-page1-overlap-radix", "qwen3_swa", "windows", {"page_size": 1, "overlap": True},
     False),
    ("mistral-page1-overlap", "mistral", "windows", {"page_size": 1, "overlap": True}, False),
    ("llama-page1-gloo-all-reduce", "llama", "windows",
     {"page_size": 1, "tp_shm_all_reduce": False}, False),
    ("gemma3-page16-chunk16-sessions", "gemma3", "windows",
     {"page_size": 16, "chunked_prefill_size": 16, "cache": "streaming_session"}, True),
]


def _greedy(max_new: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]


class TestTensorParallelGreedy(EngineTest):
    @pytest.mark.parametrize(("case", "arch", "workload", "overrides", "session"), CASES,
                             ids=[c[0] for c in CASES])
    def test_tp2_equals_tp1_and_transformers(
        self, case: str, arch: str, workload: str, overrides: dict[str, Any], session: bool,
        tp_models: Callable[[str], Path],
    ) -> None:
        model_dir = tp_models(arch)
        prompts, max_new = WORKLOADS[workload]()
        expected = reference(model_dir, prompts, max_new)
        with self.engine(model=str(model_dir), **overrides) as one:
            tp1 = [r.token_ids for r in one.generate(prompts, _greedy(max_new))]
            whole = RankMemory.of(one.model, one.kv_pool, one.kv.allocator.total_slots)
        assert tp1 == expected, "TP=1 itself differs from transformers"
        with self.engine(model=str(model_dir), tp_size=2, **overrides) as engine:
            assert engine.tp is not None and engine.tp.world_size == 2
            assert engine.backend.ctx.num_heads == engine.arch.num_attention_heads // 2
            shared = overrides.get("tp_shm_all_reduce", True) and shm_all_reduce.available()
            assert engine.stats()["tensor_parallel"]["all_reduce"] == (
                "shared memory" if shared else "gloo")
            per_rank = engine.stats()["tensor_parallel"]["memory_per_rank"]
            assert len(per_rank) == 2
            for held in per_rank:  # each rank holds about half the weights and KV heads
                assert held["weights_bytes"] <= 0.6 * whole.weights_bytes, (held, whole)
                assert held["kv_pool_bytes"] / held["kv_pool_slots"] <= \
                    0.6 * whole.kv_pool_bytes / whole.kv_pool_slots, (held, whole)
            for round_ in range(2):  # the second round starts from a warm prefix cache
                results = engine.generate(prompts, _greedy(max_new))
                assert [r.error for r in results] == [None] * len(prompts)
                assert_greedy_close(model_dir, prompts, [r.token_ids for r in results],
                                    expected, f"{case} round {round_}")
                self.assert_idle_memory_whole(engine)
            if workload == "retract":
                assert engine.stats()["retracted_reqs"] > 0, "the pool was meant to retract"
            if session:
                self._two_turns(engine, model_dir, prompts[0][:40], prompts[1][:10], case)
            checks = engine.hook_pm.get_plugins()
            assert any(type(p).__name__ == "CrossRankCheck" and p.checks > 0 for p in checks)

    def _two_turns(self, engine: Engine, model_dir: Path, first: list[int], second: list[int],
                   case: str) -> None:
        """A streaming session at TP=2: each turn's tokens are what the whole conversation
        sent as one prompt gives."""
        sid = engine.open_session()
        sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
        (a,) = engine.generate([first], sp, session_id=sid)
        assert_greedy_close(model_dir, [first], [a.token_ids],
                            reference(model_dir, [first], [16]), f"{case} session turn 1")
        (b,) = engine.generate([second], sp, session_id=sid)
        whole = first + a.token_ids + second
        assert b.stats["cached_tokens"] > 0, "the second turn was meant to reuse the session"
        assert_greedy_close(model_dir, [whole], [b.token_ids],
                            reference(model_dir, [whole], [16]), f"{case} session turn 2")
        engine.close_session(sid)
        engine.scheduler.settle_idle()  # the idle checks (both ranks) with the session closed
        self.assert_idle_memory_whole(engine)


def test_the_closeness_rule_can_fail(tp_models: Callable[[str], Path]) -> None:
    """A token outside transformers' top 5 is a real difference, not a near tie."""
    import torch

    model_dir = tp_models("llama")
    prompt = random_prompts(1, VOCAB, 12, 12, seed=4)[0]
    (expected,) = reference(model_dir, [prompt], [8])
    assert_greedy_close(model_dir, [prompt], [expected], [expected], "identical")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + expected[:3]])).logits[0, -1]
    worst = int(logits.argmin())
    wrong = [*expected[:3], worst, *expected[4:]]
    with pytest.raises(AssertionError, match="first difference at new token 3"):
        assert_greedy_close(model_dir, [prompt], [wrong], [expected], "a real difference")
