"""`plugserve generate` on a tiny random model: the text and stats the engine produces,
`--json`, `--chat`, stdin, several prompts, rejected requests, plugin warnings.

Runs with `--mem-check 1`, so plugserve-checker must be installed
(`pip install --no-deps -e plugins/checker`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.config import EngineConfig
from plugserve.engine import Engine
from plugserve.sampling import SamplingParams

ENV = {"PLUGSERVE_PLUGINS": "checker"}
PROMPTS = ["hello world", "the cat sat"]


def generate(cli: Callable[..., Any], model: Path, *args: str, **kwargs: Any) -> Any:
    env = kwargs.pop("env", ENV)
    return cli(
        "generate",
        "--model",
        str(model),
        "--mem-check",
        "1",
        "--max-new-tokens",
        "6",
        *args,
        env=env,
        **kwargs,
    )


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> dict[str, list[Any]]:
    """What the engine itself returns for PROMPTS, plain and as chat."""
    config = EngineConfig(model=str(tiny_model_dir), mem_check=1, plugins="checker")
    sampling = SamplingParams(max_new_tokens=6)
    with Engine(config) as engine:
        return {
            "plain": engine.generate(PROMPTS, sampling),
            "chat": engine.generate(PROMPTS, sampling, chat=True),
        }


def test_prints_the_engines_text_and_stats(
    cli: Callable[..., Any], tiny_model_dir: Path, expected: dict[str, list[Any]]
) -> None:
    run = generate(cli, tiny_model_dir, PROMPTS[0])
    assert run.exit_code == 0, run.stderr
    assert run.stdout == expected["plain"][0].text + "\n"
    header = run.stderr_lines[0].split()
    assert header == ["#", "prompt", "tok", "output", "tok", "finish", "ttft", "s", "tok/s"]
    row = run.stderr_lines[1].split()
    assert row[:4] == ["0", str(expected["plain"][0].prompt_tokens), "6", "length"]
    assert float(row[5]) > 0


def test_json_document(
    cli: Callable[..., Any], tiny_model_dir: Path, expected: dict[str, list[Any]]
) -> None:
    run = generate(cli, tiny_model_dir, *PROMPTS, "--json")
    assert run.exit_code == 0, run.stderr
    document = json.loads(run.stdout)
    assert document["config"]["model"] == str(tiny_model_dir)
    assert document["config"]["mem_check"] == 1
    for result, want in zip(document["results"], expected["plain"], strict=True):
        assert result["text"] == want.text
        assert result["token_ids"] == want.token_ids
        assert result["prompt_tokens"] == want.prompt_tokens
        assert result["output_tokens"] == 6
        assert result["finish_reason"] == "length"
        assert result["error"] is None
        assert result["stats"]["output_tokens_per_s"] > 0
    assert [r["prompt"] for r in document["results"]] == PROMPTS
    assert "kv_total_slots" in document["engine_stats"]


def test_several_prompts_are_labelled(
    cli: Callable[..., Any], tiny_model_dir: Path, expected: dict[str, list[Any]]
) -> None:
    run = generate(cli, tiny_model_dir, *PROMPTS)
    assert run.exit_code == 0, run.stderr
    want = "".join(
        f"--- [{i}] {prompt!r}\n{result.text}\n"
        for i, (prompt, result) in enumerate(zip(PROMPTS, expected["plain"], strict=True))
    )
    assert run.stdout == want


def test_chat_uses_the_chat_template(
    cli: Callable[..., Any], tiny_model_dir: Path, expected: dict[str, list[Any]]
) -> None:
    run = generate(cli, tiny_model_dir, PROMPTS[0], "--chat", "--json")
    result = json.loads(run.stdout)["results"][0]
    assert result["token_ids"] == expected["chat"][0].token_ids
    assert result["prompt_tokens"] == expected["chat"][0].prompt_tokens
    assert result["prompt_tokens"] > expected["plain"][0].prompt_tokens


def test_reads_the_prompt_from_stdin(
    cli: Callable[..., Any], tiny_model_dir: Path, expected: dict[str, list[Any]]
) -> None:
    run = generate(cli, tiny_model_dir, input=PROMPTS[1] + "\n")
    assert run.exit_code == 0, run.stderr
    assert run.stdout == expected["plain"][1].text + "\n"


def test_rejected_request_fails_with_its_reason(
    cli: Callable[..., Any], tiny_model_dir: Path
) -> None:
    run = generate(cli, tiny_model_dir, "x" * 600, "--json")
    assert run.exit_code == 1
    assert json.loads(run.stdout)["results"][0]["error"]
    (line,) = run.stderr_lines
    assert line.startswith("error: request 0 rejected: prompt has 600 tokens")


def test_plugin_backend_gives_the_same_text(
    cli: Callable[..., Any],
    tiny_model_dir: Path,
    expected: dict[str, list[Any]],
    dummy_plugins: Path,
) -> None:
    run = generate(
        cli,
        tiny_model_dir,
        PROMPTS[0],
        "--plugin",
        "good",
        "--attention",
        "dummy_attention",
        "--cache",
        "dummy_cache",
    )
    assert run.exit_code == 0, run.stderr
    assert run.stdout == expected["plain"][0].text + "\n"


def test_broken_plugins_are_warnings_and_the_rest_runs(
    cli: Callable[..., Any],
    tiny_model_dir: Path,
    expected: dict[str, list[Any]],
    dummy_plugins: Path,
) -> None:
    run = generate(cli, tiny_model_dir, PROMPTS[0], "--plugin", "no:duplicate_name", env={})
    assert run.exit_code == 0, run.stderr
    assert run.stdout == expected["plain"][0].text + "\n"
    warnings = [line for line in run.stderr_lines if line.startswith("warning:")]
    warnings = [line for line in warnings if "plugserve-dummy" in line]  # only ours
    assert warnings == [
        "warning: plugin 'bad_signature' (plugserve-dummy-bad-signature) failed at validate: "
        "hook plugserve_register_cache_policies takes options, which its spec does not pass "
        "(it passes: register); it is not loaded",
        "warning: plugin 'broken_import' (plugserve-dummy-broken-import) failed at import: "
        "ImportError: plugserve_dummy_broken_import needs the package "
        "'not_installed_anywhere'; it is not loaded",
        "warning: plugin 'misspelt_hook' (plugserve-dummy-misspelt-hook) failed at validate: "
        "unknown hook plugserve_register_attention_backend (did you mean "
        "plugserve_register_attention_backends?); it is not loaded",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_start_up_error(
    cli: Callable[..., Any], tiny_model_dir: Path
) -> None:
    """`--device cuda` here is refused at start-up (plugserve.device.device_problems, called
    by the engine), not by an assertion from inside torch."""
    run = cli("generate", "--device", "cuda", "hi", "--model", str(tiny_model_dir),
              env={"PLUGSERVE_PLUGINS": ""})
    assert run.exit_code == 1, run.stderr
    (line,) = run.stderr_lines
    assert line.startswith("error: unsupported configuration: "), line
    assert "device 'cuda' was requested but CUDA is not available" in line, line
    assert "allowed here: 'cpu'" in line, line
    assert "--debug" not in line and "AssertionError" not in line, line


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }} ||{% endfor %}"


@pytest.mark.parametrize("as_file", [False, True], ids=["text", "file"])
def test_chat_template_override(cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path,
                                as_file: bool) -> None:
    """`--chat-template` (a file or the text) replaces the model's template: the prompt is the
    override's rendering, token for token."""
    value = TEMPLATE
    if as_file:
        value = str(tmp_path / "template.jinja")
        Path(value).write_text(TEMPLATE, encoding="utf-8")
    run = generate(cli, tiny_model_dir, PROMPTS[0], "--chat", "--chat-template", value,
                   "--json")
    assert run.exit_code == 0, run.stderr
    result = json.loads(run.stdout)["results"][0]
    config = EngineConfig(model=str(tiny_model_dir), mem_check=1, plugins="checker")
    with Engine(config) as engine:
        rendered = f"[user] {PROMPTS[0]} ||"
        ids = engine.tokenizer.backend.encode(rendered, add_special_tokens=False).ids
        (want,) = engine.generate([list(ids)], SamplingParams(max_new_tokens=6))
    assert result["prompt_tokens"] == len(ids)
    assert result["token_ids"] == want.token_ids


@pytest.mark.parametrize(("value", "words"), [
    ("no-such-file.jinja", "no such file, and not a Jinja template"),
    ("{% for m in messages %}", "the chat template is not valid Jinja"),
])
def test_chat_template_refused_before_the_model_loads(
        cli: Callable[..., Any], tiny_model_dir: Path, value: str, words: str) -> None:
    run = generate(cli, tiny_model_dir, "hi", "--chat", "--chat-template", value)
    assert run.exit_code == 1
    assert words in run.stderr
