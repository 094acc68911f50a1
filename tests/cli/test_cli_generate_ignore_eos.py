"""`plugserve generate --ignore-eos`: fixed-length runs even when the model says EOS first.

The tiny model is copied with its generation config naming, besides its own EOS, the token
it generates first for the prompt: without --ignore-eos the request stops there, with it
the request runs to --max-new-tokens. `--mem-check 1` (the invariant checker) throughout.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = {"PLUGSERVE_PLUGINS": "checker"}
PROMPT = "the cat sat"


def generate_json(cli: Callable[..., Any], model: Path, *args: str) -> dict[str, Any]:
    run = cli("generate", "--model", str(model), "--mem-check", "1", "--json", *args, PROMPT,
              env=ENV)
    assert run.exit_code == 0, run.stderr
    (result,) = json.loads(run.stdout)["results"]
    return dict(result)


def test_ignore_eos_runs_to_max_new_tokens_past_an_eos(
    cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = generate_json(cli, tiny_model_dir, "--max-new-tokens", "12", "--ignore-eos")
    assert first["output_tokens"] == 12
    eos_first = first["token_ids"][0]
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [config["eos_token_id"], eos_first]}))

    stopped = generate_json(cli, model, "--max-new-tokens", "12")
    assert stopped["token_ids"] == [eos_first]
    assert stopped["finish_reason"] == "stop"

    ignored = generate_json(cli, model, "--max-new-tokens", "12", "--ignore-eos")
    assert ignored["output_tokens"] == 12 and len(ignored["token_ids"]) == 12
    assert ignored["token_ids"] == first["token_ids"]  # the same greedy continuation
    assert ignored["finish_reason"] == "length"
