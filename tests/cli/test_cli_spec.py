"""`plugserve generate --spec eagle`: speculative decoding from the command line.

The tiny random model with a tiny EAGLE head trained for it: greedy output equals plain
decoding, `--json` carries each request's speculative stats, and bad combinations end as one
clear error line. Needs plugserve-checker and plugserve-spec-eagle installed
(`pip install --no-deps -e plugins/checker -e plugins/spec_eagle`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("plugserve_spec_eagle")
pytestmark = pytest.mark.integration  # runs the eagle plugin

ENV = {"PLUGSERVE_PLUGINS": "checker,eagle"}
PROMPTS = ["hello world", "the cat sat on the mat"]
MAX_NEW = 12
STEPS, TOPK, DRAFT_TOKENS = 2, 2, 4
SPEC_ARGS = ("--spec", "eagle", "--spec-steps", str(STEPS), "--spec-topk", str(TOPK),
             "--spec-draft-tokens", str(DRAFT_TOKENS))



@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    return make_tiny_head_dir(tiny_model_dir, tmp_path_factory.mktemp("head"), trained=True)


def generate(cli: Callable[..., Any], model: Path, *args: str, env: dict[str, str] | None = None,
             **kwargs: Any) -> Any:
    return cli("generate", "--model", str(model), "--mem-check", "1", "--max-new-tokens",
               str(MAX_NEW), *args, env=ENV if env is None else env, **kwargs)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> dict[str, Any]:
    """The plain (non-speculative) greedy document for PROMPTS, through the same CLI."""
    from typer.testing import CliRunner

    from plugserve.cli import app
    from plugserve.plugins import clear_plugin_hosts

    clear_plugin_hosts()
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_model_dir),
                                      "--max-new-tokens", str(MAX_NEW), "--json", *PROMPTS],
                                env=ENV)
    clear_plugin_hosts()
    assert result.exit_code == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def test_json_carries_spec_stats_per_request(
    cli: Callable[..., Any], tiny_model_dir: Path, head_dir: Path, plain: dict[str, Any]
) -> None:
    run = generate(cli, tiny_model_dir, *SPEC_ARGS, "--draft-model", str(head_dir), "--json",
                   *PROMPTS)
    assert run.exit_code == 0, run.stderr
    document = json.loads(run.stdout)
    config = document["config"]
    assert config["spec"] == "eagle"
    assert config["draft_model"] == str(head_dir)
    assert (config["spec_steps"], config["spec_topk"], config["spec_draft_tokens"]) == (
        STEPS, TOPK, DRAFT_TOKENS)
    assert config["mem_check"] == 1
    accepted_total = 0
    for result, want in zip(document["results"], plain["results"], strict=True):
        # Greedy speculative decoding is lossless.
        assert result["token_ids"] == want["token_ids"]
        assert result["text"] == want["text"]
        assert result["output_tokens"] == MAX_NEW
        assert result["error"] is None
        stats = result["stats"]
        steps = stats["spec_verify_steps"]
        accepted = stats["spec_accepted_tokens"]
        hist = {int(k): v for k, v in stats["spec_accept_hist"].items()}
        assert isinstance(steps, int) and steps >= 1
        assert sum(hist.values()) == steps
        assert all(1 <= k <= STEPS + 1 for k in hist)
        assert sum((k - 1) * n for k, n in hist.items()) == accepted
        assert stats["spec_accept_len_mean"] == pytest.approx((accepted + steps) / steps)
        # The prefill emits the first token, the rounds the rest (the last one may be cut).
        emitted = 1 + sum(k * n for k, n in hist.items())
        assert emitted - (STEPS + 1) < MAX_NEW <= emitted
        accepted_total += accepted
    assert accepted_total > 0, "the trained head never got a draft token accepted"
    timings = document["engine_stats"]["step_time_s"]
    assert {"draft", "verify", "accept"} <= set(timings)


def test_text_output_is_the_plain_text(
    cli: Callable[..., Any], tiny_model_dir: Path, head_dir: Path, plain: dict[str, Any]
) -> None:
    run = generate(cli, tiny_model_dir, *SPEC_ARGS, "--draft-model", str(head_dir), PROMPTS[0])
    assert run.exit_code == 0, run.stderr
    assert run.stdout == plain["results"][0]["text"] + "\n"


def test_text_table_shows_spec_stats(
    cli: Callable[..., Any], tiny_model_dir: Path, head_dir: Path
) -> None:
    run = generate(cli, tiny_model_dir, *SPEC_ARGS, "--draft-model", str(head_dir), PROMPTS[0])
    assert run.exit_code == 0, run.stderr
    header = run.stderr_lines[0].lower()
    assert "accept" in header or "spec" in header, run.stderr


def test_chain_and_paged_tree(
    cli: Callable[..., Any], tiny_model_dir: Path, head_dir: Path, plain: dict[str, Any]
) -> None:
    # topk 1 leaves --spec-draft-tokens out (a chain verifies steps + 1 tokens); a paged tree
    # takes the holey branch layout.
    for args in (("--spec-topk", "1", "--spec-steps", "3"),
                 ("--spec-topk", "4", "--spec-steps", "3", "--page-size", "16")):
        run = generate(cli, tiny_model_dir, "--spec", "eagle", "--draft-model", str(head_dir),
                       *args, "--json", *PROMPTS)
        assert run.exit_code == 0, run.stderr
        results = json.loads(run.stdout)["results"]
        assert [r["token_ids"] for r in results] == [r["token_ids"] for r in plain["results"]]
        assert all(r["stats"]["spec_verify_steps"] >= 1 for r in results)


ERRORS: dict[str, tuple[list[str], dict[str, str], str]] = {
    # case: (arguments after --model, extra environment, the start of the error line)
    "chain with a tree budget": (
        ["--spec", "eagle", "--draft-model", "{head}", "--spec-steps", "2", "--spec-topk", "1",
         "--spec-draft-tokens", "7"],
        {},
        "error: invalid configuration: spec_draft_tokens=7 with spec_topk=1: a chain verifies "
        "exactly spec_steps + 1 = 3 tokens; leave it unset or use spec_topk > 1",
    ),
    "tree budget larger than drafted": (
        ["--spec", "eagle", "--draft-model", "{head}", "--spec-steps", "2", "--spec-topk", "2",
         "--spec-draft-tokens", "9"],
        {},
        "error: invalid configuration: spec_draft_tokens=9 must be between 2 and 7",
    ),
    "zero steps": (
        ["--spec", "eagle", "--draft-model", "{head}", "--spec-steps", "0"],
        {},
        "error: invalid configuration: spec_steps=0: Input should be greater than or equal "
        "to 1",
    ),
    "missing draft folder": (
        ["--spec", "eagle", "--draft-model", "{missing}"],
        {},
        "error: {missing}: EAGLE head folder does not exist (or is not a folder)",
    ),
    "target model as the draft": (
        ["--spec", "eagle", "--draft-model", "{model}"],
        {},
        "error: {model}/config.json: not a plugserve EAGLE head config",
    ),
    "no draft model": (
        ["--spec", "eagle"],
        {},
        "error: unsupported configuration: speculative algorithm 'eagle' needs a draft model; "
        "set draft_model (--draft-model PATH)",
    ),
    "unknown algorithm": (
        ["--spec", "eagel", "--draft-model", "{head}"],
        {},
        "error: unsupported configuration: unknown speculative algorithm 'eagel'; available: "
        "eagle, none",
    ),
    # generate has no --enable-mixed-chunk flag; the setting comes from the environment.
    "mixed chunk with spec": (
        ["--spec", "eagle", "--draft-model", "{head}"],
        {"PLUGSERVE_ENABLE_MIXED_CHUNK": "1"},
        "error: invalid configuration: enable_mixed_chunk cannot be combined with speculative "
        "decoding (spec='eagle')",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_combinations_give_one_clear_line(
    cli: Callable[..., Any], tiny_model_dir: Path, head_dir: Path, tmp_path: Path, case: str
) -> None:
    args, extra_env, want = ERRORS[case]
    names = {"head": str(head_dir), "model": str(tiny_model_dir),
             "missing": str(tmp_path / "no_such_head")}
    run = generate(cli, tiny_model_dir, *[a.format(**names) for a in args], "hi",
                   env={**ENV, **extra_env})
    assert run.exit_code == 1
    (line,) = run.stderr_lines
    assert line.startswith(want.format(**names)), line
    assert "Traceback" not in run.stderr
    assert run.stdout == ""
