"""`plugserve bench` reports the workload's share of the GEMM peak measured in the same run:
the FLOP count matches the rows the engine's forwards really computed, the peak is measured
through the engine's linears, and the report carries and prints both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.bench.gemm_peak import _keys_read, gemm_share, measure_peak, workload_flops
from plugserve.bench.report import gemm_line
from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.testing.reference import random_prompts


def test_keys_read_counts_each_position() -> None:
    for tokens in (1, 5, 17):
        for window in (None, 1, 4, 30):
            brute = sum(min(j + 1, window) if window else j + 1 for j in range(tokens))
            assert _keys_read(tokens, window) == brute


def test_flops_count_the_rows_the_engine_computes(tiny_model_dir: Path) -> None:
    prompts = random_prompts(3, 256, 10, 40, seed=3)
    outputs = [5, 9, 16]
    rows: list[int] = []
    sampled: list[int] = []
    with Engine(model=str(tiny_model_dir), cache="none") as engine:
        forward = engine.model.forward

        def counting(forward_batch: Any, backend: Any) -> Any:
            rows.append(forward_batch.num_tokens)
            out = forward(forward_batch, backend)
            sampled.append(len(forward_batch.seq_lens_cpu))
            return out

        engine.model.forward = counting  # type: ignore[method-assign]
        engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                  for n in outputs])
        flops = workload_flops(engine.model, engine.arch, [len(p) for p in prompts], outputs)
        arch = engine.arch
        per_row = sum(2 * m.weight.numel() for layer in engine.model.decoder_layers
                      for m in layer.modules() if hasattr(m, "weight") and m.weight.dim() == 2)
    assert flops.linear == per_row * sum(rows)
    assert sum(rows) == sum(len(p) + n - 1 for p, n in zip(prompts, outputs, strict=True))
    assert flops.lm_head == 2 * arch.vocab_size * arch.hidden_size * sum(sampled)
    assert flops.attention > 0


def test_peak_and_share_on_the_engine(tiny_model_dir: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with Engine(model=str(tiny_model_dir)) as engine:
        peak = measure_peak(engine.model, engine.dtype, engine.device)
        share = gemm_share(engine, [20, 30], [8, 8], 0.5)
    assert set(peak["by_rows"]) == {"64", "512", "2048"}
    assert peak["flop_per_s"] == max(peak["by_rows"].values()) > 0
    assert share["dtype"] == "float32"
    assert share["fraction"] == pytest.approx(share["flop_per_s"] / share["peak_flop_per_s"])
    assert share["flop_per_s"] == pytest.approx(share["flops"] / 0.5)
    gemm_line(share, _console())
    assert "of the peak" in " ".join(capsys.readouterr().out.split())  # a narrow console wraps


def _console() -> Any:
    from rich.console import Console

    return Console(width=200)


def test_bf16_peak_is_measured_in_bf16(tiny_model_dir: Path) -> None:
    with Engine(model=str(tiny_model_dir), dtype="bfloat16") as engine:
        share = gemm_share(engine, [20], [4], 0.1)
        assert all(layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
                   for layer in engine.model.decoder_layers)
    assert share["dtype"] == "bfloat16"


def test_the_higher_of_two_peak_readings_is_used(tiny_model_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A reading taken before the run that is higher than the one after it is the peak the
    share is counted against (and a lower one is not), and both are printed."""
    with Engine(model=str(tiny_model_dir)) as engine:
        after_only = gemm_share(engine, [20], [4], 0.1)
        fast = {"flop_per_s": 1e6 * after_only["peak_flop_per_s"], "rows": 7,
                "by_rows": {"7": 1.0}}
        slow = {"flop_per_s": 1e-6 * after_only["peak_flop_per_s"], "rows": 7,
                "by_rows": {"7": 1.0}}
        high = gemm_share(engine, [20], [4], 0.1, peak_before=fast)
        low = gemm_share(engine, [20], [4], 0.1, peak_before=slow)
    assert high["peak_flop_per_s"] == fast["flop_per_s"] and high["peak_rows"] == 7
    assert high["fraction"] == pytest.approx(high["flop_per_s"] / fast["flop_per_s"])
    assert high["peak_readings_flop_per_s"][0] == fast["flop_per_s"]
    assert low["peak_flop_per_s"] == low["peak_readings_flop_per_s"][1] > slow["flop_per_s"]
    assert after_only["peak_readings_flop_per_s"] == [after_only["peak_flop_per_s"]]
    gemm_line(high, _console())
    assert "the higher used" in " ".join(capsys.readouterr().out.split())

