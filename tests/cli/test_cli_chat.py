"""`plugserve chat` on a tiny random model, stdin piped through typer's CliRunner.

Every reply must equal what `Engine.generate` (no session, no prefix cache) gives for the
whole conversation re-sent as one prompt, that prompt being the chat-template rendering of
the conversation; `/undo`, `/reset` and `/stats` act on the session; the engine's memory is
whole when the chat ends. Runs with `--mem-check 1`, so plugserve-checker must be installed.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from plugserve.cli.chat import ReplyPrinter, render_plain, turn_tokens
from plugserve.engine import Engine
from plugserve.model.tokenizer import Tokenizer
from plugserve.sampling import SamplingParams
from plugserve.testing.memory import assert_memory_whole

ENV = {"PLUGSERVE_PLUGINS": "checker"}
OUT = 8
SCRIPT = ["hello", "how are you", "/undo", "tell me more", "/stats", "/reset", "hi again"]
STATS = re.compile(r"session: (\d+) tokens, (\d+) messages; last turn: (\d+) prompt tokens, "
                   r"(\d+) computed, (\d+) cached, (\d+) output tokens, TTFT ([\d.]+) s")


def chat(cli: Callable[..., Any], model: Path, lines: list[str], *args: str) -> Any:
    return cli("chat", "--model", str(model), "--mem-check", "1", "--max-new-tokens", str(OUT),
               *args, env=ENV, input="".join(f"{line}\n" for line in lines))


def reference(model: Path, lines: list[str], render: Callable[[list[dict[str, str]]], str],
              prefix: list[int] | None = None) -> dict[str, Any]:
    """The conversation replayed on an engine without sessions: each turn sends the whole
    rendering at once. Returns the replies and, per /stats, (session length, prompt tokens,
    new tokens, offset)."""
    replies: list[str] = []
    stats: list[tuple[int, int, int, int]] = []
    messages: list[dict[str, str]] = []
    held: list[int] = []
    undo: list[tuple[list[int], int]] = []
    last = (0, 0, 0)
    sampling = SamplingParams(max_new_tokens=OUT)
    with Engine(model=str(model), cache="none") as engine:
        tok = engine.tokenizer
        for line in lines:
            if line == "/undo":
                held, kept = undo.pop()
                del messages[kept:]
            elif line == "/reset":
                messages, held, undo = [], [], []
            elif line == "/stats":
                stats.append((len(held), *last))
            else:
                undo.append((list(held), len(messages)))
                messages.append({"role": "user", "content": line})
                rendered = render(messages)
                offset, new = turn_tokens(held, rendered, tok, prefix or [])
                prompt = held[:offset] + new
                # The prompt is the rendering of the whole conversation.
                start = len(prefix or [])
                assert prompt[:start] == (prefix or [])
                assert tok.decode(prompt[start:], skip_special_tokens=False) == rendered
                (out,) = engine.generate([prompt], sampling)
                replies.append(out.text)
                messages.append({"role": "assistant", "content": out.text})
                held = prompt + out.token_ids
                last = (len(prompt), len(new), offset)
    return {"replies": replies, "stats": stats}


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Engine]]:
    """Every engine closed (the references' too), to look at its memory afterwards."""
    closed: list[Engine] = []
    real_close = Engine.close

    def close(self: Engine) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(Engine, "close", close)
    yield closed


def assert_whole(engine: Engine) -> None:
    (checker,) = engine.checkers  # it ran every step and at idle, after the session closed
    assert checker.steps_checked > 0 and checker.idle_checks > 0 and checker.failed is None
    assert_memory_whole(engine)
    assert engine.kv.sessions is not None and not engine.kv.sessions.store.slots
    assert engine.kv.rows.available_rows() == engine.kv.rows.num_rows


@pytest.mark.parametrize("page_size", [1, 4])
def test_turns_undo_stats_reset(cli: Callable[..., Any], tiny_model_dir: Path,
                                engines: list[Engine], page_size: int) -> None:
    tok = Tokenizer.from_hf_folder(tiny_model_dir)
    assert tok.chat_template is not None
    want = reference(tiny_model_dir, SCRIPT, lambda m: tok.render_chat(m))
    run = chat(cli, tiny_model_dir, SCRIPT, "--page-size", str(page_size))
    assert run.exit_code == 0, run.stderr
    assert run.stdout == "".join(f"{reply}\n" for reply in want["replies"])
    assert "undone: the session goes back to" in run.stderr
    assert "new conversation" in run.stderr
    match = STATS.search(run.stderr)
    assert match is not None, run.stderr
    length, messages, prompt, computed, cached, output, ttft = (
        float(g) if "." in g else int(g) for g in match.groups())
    ((held, want_prompt, new, offset),) = want["stats"]
    assert (length, messages, prompt, output) == (held, 4, want_prompt, OUT)
    # After /undo the session rewinds into what the undone turn computed: only the new
    # tokens are computed, everything before them is the session's.
    assert (computed, cached) == (new, offset)
    assert ttft > 0
    (engine,) = [e for e in engines if e.config.cache == "streaming_session"]
    assert_whole(engine)


def test_plain_rendering_without_a_chat_template(
    cli: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    model = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_hf_folder(model).chat_template is None
    lines = ["hello", "and then?", "/stats"]
    system = ["--system", "Be brief."]
    want = reference(model, lines,
                     lambda m: render_plain([{"role": "system", "content": "Be brief."}, *m]))
    run = chat(cli, model, lines, *system)
    assert run.exit_code == 0, run.stderr
    assert run.stdout == "".join(f"{reply}\n" for reply in want["replies"])
    match = STATS.search(run.stderr)
    assert match is not None and int(match.group(1)) == want["stats"][0][0]
    assert int(match.group(4)) in (want["stats"][0][2], want["stats"][0][2] + 1)
    assert_whole(engines[-1])


def test_commands_and_refusals(cli: Callable[..., Any], tiny_model_dir: Path) -> None:
    run = chat(cli, tiny_model_dir, ["/undo", "/stats", "/nope", "/quit", "never sent"])
    assert run.exit_code == 0, run.stderr
    assert run.stdout == ""
    assert "nothing to undo" in run.stderr and "no turn yet" in run.stderr
    assert "unknown command '/nope'" in run.stderr
    refused = chat(cli, tiny_model_dir, ["hello"], "--cache", "radix")
    assert refused.exit_code == 1
    assert refused.stderr_lines == [
        "error: chat keeps the conversation in a streaming session, and --cache 'radix' has "
        "none; leave --cache out (default streaming_session) or choose one of: "
        "streaming_session"
    ]
    bad = chat(cli, tiny_model_dir, ["hello"], "--temperature", "-1")
    assert bad.exit_code == 1 and "invalid sampling options" in bad.stderr


def test_turn_tokens_keeps_the_sessions_tokens_or_rewinds(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_hf_folder(tiny_model_dir)

    def encode(text: str) -> list[int]:
        return list(tok.backend.encode(text, add_special_tokens=False).ids)

    first = [{"role": "user", "content": "hi"}]
    assert turn_tokens([], tok.render_chat(first), tok) == (0, tok.apply_chat_template(first))
    # The session holds the prompt and a reply whose tokens are not how the tokenizer would
    # split its text (here: "ok" as the two halves of a multi-byte character, then "ok").
    reply = encode("é")[:1] + encode("ok")
    held = tok.apply_chat_template(first) + reply + [tok.bos_token_id or 0]
    reply_text = tok.decode(reply)
    later = [*first, {"role": "assistant", "content": reply_text},
             {"role": "user", "content": "more"}]
    # Not a prefix (the session also holds <s>, which the rendering lacks): rewind to the
    # longest common token prefix of the whole rendering.
    whole = tok.apply_chat_template(later)
    offset, new = turn_tokens(held, tok.render_chat(later), tok)
    assert held[:offset] + new == whole and offset == len(tok.apply_chat_template(first))
    # A prefix: only the text past it is tokenized, the reply's own tokens stay.
    held = held[:-1] + encode("</s>")
    offset, new = turn_tokens(held, tok.render_chat(later), tok)
    assert offset == len(held) and new == encode("<|user|>more</s><|assistant|>")
    # Nothing new: the last token is sent again.
    assert turn_tokens(whole, tok.render_chat(later), tok) == (len(whole) - 1, whole[-1:])


def test_reply_printer_holds_back_partial_characters_and_stop_strings(
    tiny_model_dir: Path,
) -> None:
    tok = Tokenizer.from_hf_folder(tiny_model_dir)
    ids = list(tok.backend.encode("aé\nUser: x", add_special_tokens=False).ids)
    printer = ReplyPrinter(tok.decode, holdback=len("\nUser:") - 1)
    shown = "".join(printer.feed([t]) for t in ids[:3])  # "a" and half of "é"
    assert shown == ""  # "a" is within the stop string's hold-back
    printer = ReplyPrinter(tok.decode)
    assert printer.feed(ids[:2]) == "a" and printer.feed(ids[2:3]) == "é"
    assert printer.feed(ids[3:5]) == "\nU" and printer.finish("aé\nUser") == "ser"
