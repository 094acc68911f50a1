"""EAGLE on the Triton attention backend: greedy output equals plain greedy decoding.

page_size {1, 16} × topk {1, 4} × normal/overlap loop, each case in one engine with two
drafts: the trained tiny head (the real drafting path: draft KV, branch pages, tail copies,
tree verify through the Triton kernels), then an oracle draft that proposes the target's own
continuation (every round must accept all draft tokens). Without CUDA the kernels run in the
Triton interpreter on the CPU, which is slow: the workload is smaller than test_lossless's.
The checker runs at level 1 and memory is whole at idle after every run.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from doubles import OracleDrafter
from test_lossless import SpecMatrix

from conftest import NUM_STEPS
from plugserve.engine import Engine
from plugserve.sampling import SamplingParams

pytest.importorskip("plugserve_attention_triton")

# Without CUDA the kernels need Triton's interpreter, and Triton reads TRITON_INTERPRET when
# `triton` itself is first imported. The backend sets it when it starts, but by then this
# session has trained a head: torch.optim imports torch._dynamo, which imports triton (see
# test_triton_imported_first_fails_clearly). Switch it on at collection, before any fixture.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Lengths 5 and 18: one prompt inside a page of 16, one crossing a page boundary; outputs
# cross another.
PROMPTS = [
    [7, 19, 4, 33, 2],
    [(13 * i + 5) % 240 + 3 for i in range(18)],
]
MAX_NEW = 7
CASES = [
    (page, topk, loop, "radix", 16)
    for page, topk, loop in itertools.product((1, 16), (1, 4), ("normal", "overlap"))
]


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


def _ids(case: tuple[Any, ...]) -> str:
    page, topk, loop, _, _ = case
    return f"page{page}-topk{topk}-{loop}"


@pytest.fixture(scope="module")
def small_reference(target_dir: Path) -> list[list[int]]:
    with Engine(model=str(target_dir), dtype="float32") as engine:
        return [r.token_ids for r in engine.generate(PROMPTS, _greedy(MAX_NEW))]


@pytest.fixture(scope="module")
def small_long_reference(target_dir: Path) -> list[list[int]]:
    """Prompt + a continuation long enough for the oracle's last round."""
    with Engine(model=str(target_dir), dtype="float32") as engine:
        out = engine.generate(PROMPTS, _greedy(MAX_NEW + NUM_STEPS + 2))
    return [p + r.token_ids for p, r in zip(PROMPTS, out, strict=True)]


class TestTritonSpec(SpecMatrix):
    attention = "triton"

    @pytest.fixture(autouse=True)
    def _kernels_here(self) -> None:
        if torch.cuda.is_available():
            pytest.skip("runs the engine on the CPU (Triton interpreter); GPU runs elsewhere")

    @pytest.mark.parametrize("case", CASES, ids=_ids)
    def test_greedy_is_lossless(
        self, case: tuple[Any, ...], target_dir: Path, trained_head_dir: Path,
        small_reference: list[list[int]], small_long_reference: list[list[int]],
    ) -> None:
        with self.spec_engine(target_dir, trained_head_dir, case) as engine:
            assert engine.config.attention == "triton"
            trained = engine.generate(PROMPTS, _greedy(MAX_NEW))
            assert [r.token_ids for r in trained] == small_reference
            self.assert_idle_memory_whole(engine)
            accepted = sum(r.stats["spec_accepted_tokens"] for r in trained)
            assert accepted > 0, [r.stats["spec_accept_hist"] for r in trained]

            engine.spec.drafter = OracleDrafter(
                small_long_reference, num_steps=NUM_STEPS, topk=case[1],
                num_draft_tokens=engine.config.num_draft_tokens,
                vocab=engine.arch.vocab_size,
            )
            oracle = engine.generate(PROMPTS, _greedy(MAX_NEW))
            assert [r.token_ids for r in oracle] == small_reference
            self.assert_idle_memory_whole(engine)
        rounds = -(-(MAX_NEW - 1) // (NUM_STEPS + 1))
        assert [r.stats["spec_accept_hist"] for r in oracle] == [{NUM_STEPS + 1: rounds}] * len(
            PROMPTS)


# A fresh process that imports torch._dynamo (as constructing any torch.optim optimizer does,
# e.g. training an EAGLE head) and then runs the Triton backend on the CPU, with
# TRITON_INTERPRET left for the backend to set.
_IMPORTED_FIRST = textwrap.dedent("""
    import sys
    import torch
    import torch._dynamo  # imports triton (torch.utils._triton.has_triton_package)
    assert "triton" in sys.modules
    from plugserve.engine import Engine
    from plugserve.sampling import SamplingParams
    from plugserve_attention_triton.runtime import TritonRuntimeError
    try:
        with Engine(model=sys.argv[1], dtype="float32", attention="triton") as engine:
            out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        print("OK", out[0].token_ids)
    except TritonRuntimeError as exc:
        print("CLEAR", exc)
    except Exception as exc:
        print("CRYPTIC", type(exc).__name__, str(exc)[:300])
""")


def test_triton_imported_first_fails_clearly(target_dir: Path) -> None:
    """Either the backend runs, or it refuses with a TritonRuntimeError saying what to do."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter path only")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run([sys.executable, "-c", _IMPORTED_FIRST, str(target_dir)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(("OK", "CLEAR")), run.stdout
