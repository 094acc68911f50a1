"""`benchmarks/roofline.py --split`: the parts of a decode step it times on the tiny model
(the checker at level 1 with physical page checks; the normal and the overlap loop), and the
timers gone afterwards."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from plugserve.engine import Engine
from plugserve.kernels import decode_layer
from plugserve.model.llama import CausalLM

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "roofline.py"


def load_roofline() -> ModuleType:
    spec = importlib.util.spec_from_file_location("roofline_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["roofline_script"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not decode_layer.available(),
                    reason=f"the compiled decode stack is unavailable: "
                           f"{decode_layer.why_unavailable()}")
@pytest.mark.parametrize("overlap", [False, True])
def test_split_times_every_part_of_the_decode_steps(tiny_model_dir: Path, overlap: bool) -> None:
    roofline = load_roofline()
    originals = (decode_layer.DecodeStack.run, CausalLM.compute_logits, CausalLM.forward)
    with Engine(model=str(tiny_model_dir), dtype="float32", mem_check=1, check_pages=True,
                overlap=overlap) as engine:
        split = roofline.step_split(engine, [5, 6, 7, 8, 9], 12)
        # the LM head's bytes as the script divides them (a leak would have stopped the run)
        head_bytes = engine.model.lm_head_holder.resident_bytes()
    assert (decode_layer.DecodeStack.run, CausalLM.compute_logits, CausalLM.forward) == originals
    assert split is not None
    assert split["stack_s"] > 0 and split["lm_head_s"] > 0
    # The parts are medians of the same steps: the forward's rest and the step's rest are
    # what remains of the medians, never negative beyond rounding.
    assert split["forward_rest_s"] > -1e-4 and split["outside_forward_s"] > -1e-4
    assert split["step_s"] >= split["stack_s"]
    arch = engine.arch
    assert head_bytes == arch.vocab_size * arch.hidden_size * 4  # a float32 [vocab, hidden] head


@pytest.mark.parametrize("overlap", [False, True])
def test_paired_runs_hold_each_run_against_its_neighbouring_readings(
        tiny_model_dir: Path, overlap: bool) -> None:
    roofline = load_roofline()
    with Engine(model=str(tiny_model_dir), dtype="float32", mem_check=1,
                check_pages=True, overlap=overlap) as engine:
        paired = roofline.paired_fractions(engine, [5, 6, 7, 8, 9], 6, runs=3,
                                           step_bytes=1e6, mib=8)
    readings, tpots = paired["read_gb_s"], paired["tpot_s"]
    assert len(readings) == 4 and len(tpots) == 3  # a reading before the first run, one after each
    assert all(r > 0 for r in readings) and all(t > 0 for t in tpots)
    # Run i against the higher (stricter) of the readings just before and just after it.
    expected = [1e6 / (max(readings[i], readings[i + 1]) * 1e9) / tpot
                for i, tpot in enumerate(tpots)]
    assert paired["fractions"] == pytest.approx(expected)
    assert paired["median_fraction"] == pytest.approx(sorted(expected)[1])
