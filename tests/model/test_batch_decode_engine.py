"""An engine's decode batches past the few-row kernel run through the compiled decode stack
(`plugserve.kernels.decode_layer.DecodeStack`): in float32 (the panel GEMM inside)
token-identical to transformers, in bf16 on AMX (the AMX linear inside) token-identical to
the layers run one by one; with the invariant checker on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.kernels import decode_batch as db
from plugserve.kernels import decode_layer as dl
from plugserve.kernels import dense_amx, skinny_linear
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts
from plugserve.testing.tiny_models import make_tiny_model_dir

VOCAB = 256
REQUESTS = 20


@pytest.fixture(scope="module")
def model_and_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[list[int]], list[int], list[list[int]]]:
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=4)
    prompts = random_prompts(REQUESTS, VOCAB, 3, 30, seed=2)
    max_new = [6 + (5 * i) % 17 for i in range(REQUESTS)]  # the batch shrinks as they end
    return model_dir, prompts, max_new, hf_greedy(model_dir, prompts, max_new)


class TestBatchDecodeThroughTheStack(EngineTest):
    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_twenty_requests_match_transformers(
        self, model_and_reference: tuple[Path, list[list[int]], list[int], list[list[int]]],
        monkeypatch: pytest.MonkeyPatch, overlap: bool,
    ) -> None:
        if not dl.available():
            pytest.skip(f"decode_layer kernel unavailable: {dl.why_unavailable()}")
        model_dir, prompts, max_new, expected = model_and_reference
        batch_rows = _record_batch_rows(monkeypatch)
        with self.engine(model=str(model_dir), dtype="float32", overlap=overlap) as engine:
            assert _generate(engine, prompts, max_new) == expected
        # the full batch's decode steps (20 rows) went through the stack in one call each
        assert REQUESTS in batch_rows

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_bf16_on_amx_matches_the_layers_one_by_one(
        self, model_and_reference: tuple[Path, list[list[int]], list[int], list[list[int]]],
        monkeypatch: pytest.MonkeyPatch, overlap: bool,
    ) -> None:
        if not dl.available() or not dense_amx.amx_usable():
            pytest.skip("the bf16 batch path needs the AMX linear (AMX-BF16 and its kernels)")
        model_dir, prompts, max_new, _ = model_and_reference
        batch_rows = _record_batch_rows(monkeypatch)
        outputs = []
        for stacked in (True, False):
            monkeypatch.setattr(db, "_ENABLED", stacked)
            with self.engine(model=str(model_dir), dtype="bfloat16", overlap=overlap) as engine:
                outputs.append(_generate(engine, prompts, max_new))
            assert (REQUESTS in batch_rows) == stacked
            batch_rows.clear()
        assert outputs[0] == outputs[1]


def _record_batch_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets the rows of every `DecodeStack.run` past the few-row kernel."""
    batch_rows: list[int] = []
    real_run = dl.DecodeStack.run

    def recording(self: dl.DecodeStack, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        if hidden.shape[0] > skinny_linear.MAX_ROWS:
            batch_rows.append(hidden.shape[0])
        return real_run(self, hidden, *args)

    monkeypatch.setattr(dl.DecodeStack, "run", recording)
    return batch_rows


def _generate(engine: Any, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Greedy tokens of every prompt; the engine's memory whole once they are done."""
    sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]
    tokens = [r.token_ids for r in engine.generate(prompts, sampling)]
    EngineTest.assert_idle_memory_whole(engine)
    return tokens
