"""`--quantization` and `--quant-activations` on `plugserve generate`: the options reach the
engine, `--json` reports the resident `weight_bytes`, and a value outside the allowed ones
is refused with them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plugserve.engine import Engine

ENV = {"PLUGSERVE_PLUGINS": "checker"}


def _generate(cli: Callable[..., Any], model: Path, *args: str) -> Any:
    return cli("generate", "--model", str(model), "--mem-check", "1", "--max-new-tokens", "5",
               "hello world", "--json", *args, env=ENV)


def test_quantized_generate_reports_its_weight_bytes(
    cli: Callable[..., Any], tiny_model_dir: Path
) -> None:
    dense = _generate(cli, tiny_model_dir)
    run = _generate(cli, tiny_model_dir, "--quantization", "q8_0", "--quant-activations",
                    "float")
    assert run.exit_code == 0, run.stderr
    document = json.loads(run.stdout)
    assert document["config"]["quantization"] == "q8_0"
    assert document["config"]["quant_activations"] == "float"
    with Engine(model=str(tiny_model_dir), quantization="q8_0",
                quant_activations="float") as engine:
        (want,) = engine.generate(["hello world"], None)
        held = engine.weight_bytes
    assert document["engine_stats"]["weight_bytes"] == held
    assert held < 0.5 * json.loads(dense.stdout)["engine_stats"]["weight_bytes"]
    assert document["results"][0]["token_ids"] == want.token_ids[:5]


def test_an_unknown_quantization_is_refused_with_the_allowed_ones(
    cli: Callable[..., Any], tiny_model_dir: Path
) -> None:
    run = _generate(cli, tiny_model_dir, "--quantization", "q3_k")
    assert run.exit_code != 0
    assert "q3_k" in run.stderr and "q4_k" in run.stderr
