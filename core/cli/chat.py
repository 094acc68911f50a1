"""`plugserve chat`: an interactive multi-turn chat on one streaming session.

Each user turn renders the whole conversation with the model's chat template and sends only
the tokens past what the session already holds (`turn_tokens`); the session keeps the KV of
every earlier turn, so a turn computes its new tokens only. Lines come from stdin (`input()`),
so the chat also works piped. Replies stream to stdout; notices and `/stats` go to stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer

from plugserve.cli.errors import UsageError, reported_errors
from plugserve.cli.logs import stderr_logging
from plugserve.cli.options import (
    AttentionOpt,
    CacheOpt,
    ChatTemplateOpt,
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    KVCacheDtypeOpt,
    LogLevelOpt,
    MemCheckOpt,
    ModelOpt,
    PageSizeOpt,
    PluginOpt,
    QuantActivationsOpt,
    QuantizationOpt,
    TpOpt,
    chat_template_option,
    checked_plugin_host,
    engine_config,
    followed_rank_0,
)
from plugserve.detokenize import IncrementalText

if TYPE_CHECKING:
    from plugserve.engine import Engine
    from plugserve.model.tokenizer import Tokenizer
    from plugserve.sampling import SamplingParams

DEFAULT_CACHE = "streaming_session"
PLAIN_STOP = "\nUser:"  # the plain rendering's next user turn: where a reply ends
COMMANDS = "/undo /reset /stats /quit"
Message = dict[str, str]


def render_plain(messages: Sequence[Mapping[str, Any]]) -> str:
    """The rendering for a model without a chat template ("User: ...\\nAssistant:")."""
    role = {"system": "System: ", "user": "User: ", "assistant": "Assistant:"}
    text = "".join(f"{role.get(m['role'], m['role'] + ': ')}{m['content']}\n" for m in messages)
    return text + "Assistant:"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def turn_tokens(held: list[int], rendered: str, tokenizer: Tokenizer,
                prefix: Sequence[int] = ()) -> tuple[int, list[int]]:
    """`(offset, new)`: keep the session's first `offset` tokens and append `new` to hold
    `rendered` (the whole conversation, `prefix` ids such as BOS before its text).

    When the text of `held` is a prefix of `rendered`, only the text past it is tokenized
    (the session keeps the model's own reply tokens); otherwise (the template re-renders an
    earlier turn differently, or `held` has special tokens the rendering lacks) the whole
    rendering is tokenized and the session rewinds to the longest common token prefix."""
    def encode(text: str) -> list[int]:
        return list(tokenizer.backend.encode(text, add_special_tokens=False).ids)

    head = len(prefix)
    if held and held[:head] == list(prefix):
        text = tokenizer.decode(held[head:], skip_special_tokens=False)
        if rendered.startswith(text):
            new = encode(rendered[len(text):])
            if new:
                return len(held), new
    whole = list(prefix) + encode(rendered)
    offset = common_prefix_len(held, whole)
    if offset == len(whole):  # nothing new: compute the last token again
        offset -= 1
    return offset, whole[offset:]


class ReplyPrinter:
    """Text of a reply as its tokens arrive (a few tokens decoded per feed:
    `plugserve.detokenize`); an unfinished UTF-8 character (a trailing U+FFFD) or a possible
    stop string is held back."""

    def __init__(self, decode: Callable[[list[int]], str], holdback: int = 0) -> None:
        self.running = IncrementalText(decode)
        self.holdback = holdback
        self.ids: list[int] = []
        self.shown = 0

    def feed(self, ids: Sequence[int]) -> str:
        self.ids += ids
        text = self.running.text(self.ids)
        end = len(text) - self.holdback
        while end > self.shown and text[end - 1] == "\ufffd":
            end -= 1
        if end <= self.shown:
            return ""
        out, self.shown = text[self.shown : end], end
        return out

    def finish(self, text: str) -> str:
        return text[self.shown :]


class Chat:
    """One conversation on one streaming session of `engine`."""

    def __init__(self, engine: Engine, sampling: SamplingParams, system: str | None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.templated = self.tokenizer.chat_template is not None
        self.system: list[Message] = [{"role": "system", "content": system}] if system else []
        self.prefix = [] if self.templated else _bos_prefix(self.tokenizer)
        if not self.templated and not sampling.stop:
            sampling = dataclasses.replace(sampling, stop=(PLAIN_STOP,))
        self.sampling = sampling
        self.render([*self.system, {"role": "user", "content": "hi"}])  # template errors now
        self.sid = engine.open_session()
        self.messages: list[Message] = list(self.system)
        self.held: list[int] = []  # a prefix of what the session holds
        self.undo_stack: list[tuple[list[int], int]] = []  # (held, messages) before a turn
        self.last: str | None = None  # the last turn's figures

    def render(self, messages: Sequence[Message]) -> str:
        if self.templated:
            return self.tokenizer.render_chat(messages, add_generation_prompt=True)
        return render_plain(messages)

    def turn(self, text: str, write: Callable[[str], None]) -> str | None:
        """Send one user turn, streaming the reply to `write`; the error, if any."""
        before = (list(self.held), len(self.messages))
        self.messages.append({"role": "user", "content": text})
        offset, new = turn_tokens(self.held, self.render(self.messages), self.tokenizer,
                                  self.prefix)
        stats = self.engine.stats
        computed = stats().get("prefill_tokens", 0)
        stop = self.sampling.stop
        printer = ReplyPrinter(self.tokenizer.decode, max(map(len, stop)) - 1 if stop else 0)
        result = None
        for event in self.engine.stream([new], self.sampling, session_id=self.sid,
                                        session_offset=offset):
            if event.result is not None:
                result = event.result
            elif event.token_ids:
                write(printer.feed(event.token_ids))
        assert result is not None
        if result.error is not None or result.finish_reason == "abort":
            del self.messages[before[1]:]
            self.held = self.held[:offset]  # the session may have rewound to it
            if printer.shown:
                write("\n")
            return result.error or "the reply was aborted"
        write(printer.finish(result.text) + "\n")
        self.messages.append({"role": "assistant", "content": result.text})
        self.held = self.held[:offset] + new + result.token_ids
        self.undo_stack.append(before)
        computed = stats().get("prefill_tokens", 0) - computed
        figures = result.stats
        self.last = (f"{result.prompt_tokens} prompt tokens, {computed} computed, "
                     f"{figures.get('cached_tokens', 0)} cached, {result.output_tokens} output "
                     f"tokens, TTFT {_num(figures.get('ttft_s'), 3)} s, "
                     f"{_num(figures.get('output_tokens_per_s'), 1)} tok/s")
        return None

    def undo(self) -> str:
        if not self.undo_stack:
            return "nothing to undo"
        self.held, kept = self.undo_stack.pop()
        del self.messages[kept:]
        return f"undone: the session goes back to {len(self.held)} tokens at the next turn"

    def reset(self) -> str:
        self.engine.close_session(self.sid)
        self.sid = self.engine.open_session()
        self.messages, self.held, self.undo_stack, self.last = list(self.system), [], [], None
        return "new conversation" + (" (the system prompt is kept)" if self.system else "")

    def stats_line(self) -> str:
        line = f"session: {len(self.held)} tokens, {len(self.messages)} messages"
        return f"{line}; " + (f"last turn: {self.last}" if self.last else "no turn yet")

    def close(self) -> None:
        self.engine.close_session(self.sid)


def _bos_prefix(tokenizer: Tokenizer) -> list[int]:
    """BOS when the model's tokenizer puts it before a plain prompt."""
    bos = tokenizer.bos_token_id
    ids = tokenizer.encode("a")
    return [bos] if bos is not None and ids[:1] == [bos] else []


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def chat_command(
    model: ModelOpt = None,
    plugin: PluginOpt = None,
    attention: AttentionOpt = None,
    cache: CacheOpt = None,
    page_size: PageSizeOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KVCacheDtypeOpt = None,
    quantization: QuantizationOpt = None,
    quant_activations: QuantActivationsOpt = None,
    device: DeviceOpt = None,
    mem_check: MemCheckOpt = None,
    system: Annotated[str | None, typer.Option(metavar="PROMPT",
                                               help="System prompt of the conversation.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens per reply.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    tp: TpOpt = None,
    chat_template: ChatTemplateOpt = None,
    log_level: LogLevelOpt = "WARNING",
    debug: DebugOpt = False,
) -> None:
    """Chat with the model in the terminal, one streaming session for the conversation.

    \b
    Type a message and press Enter; the reply streams back. Commands:
      /undo   take back the last message and its reply
      /reset  start a new conversation (a new session)
      /stats  session length, the last turn's prompt tokens computed
              and cached, TTFT and tok/s
      /quit   end (so does end of input)
    Each turn renders the whole conversation with the model's chat template
    and sends only the tokens the session does not hold yet. A model without
    a chat template gets a plain "User: ...\\nAssistant:" rendering (a reply
    stops at the next "\\nUser:"). Needs a cache policy with sessions
    (--cache defaults to streaming_session). Lines are read from stdin, so
    the chat can be piped; replies go to stdout, the rest to stderr.
    """
    with reported_errors(debug):
        from plugserve.sampling import SamplingParams

        config = engine_config(model=model, attention=attention, cache=cache or DEFAULT_CACHE,
                               page_size=page_size, dtype=dtype,
                               kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                               quant_activations=quant_activations, device=device,
                               mem_check=mem_check, tp_size=tp)
        with stderr_logging(log_level, config.mem_check):
            options = plugin or []
            host = checked_plugin_host(options, config, debug)
            policy = host.registries.cache.get(config.cache)
            if not getattr(policy.capabilities, "sessions", False):
                with_sessions = [e.name for e in host.registries.cache
                                 if getattr(e.capabilities, "sessions", False)]
                raise UsageError(
                    f"chat keeps the conversation in a streaming session, and --cache "
                    f"{config.cache!r} has none; leave --cache out (default {DEFAULT_CACHE}) "
                    f"or choose one of: {', '.join(with_sessions) or '(none installed)'}"
                )
            sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, seed=seed)
            problems = sampling.problems(vocab_size=sys.maxsize)
            if problems:
                raise UsageError("invalid sampling options: " + "; ".join(problems))
            if followed_rank_0(config, options):  # torchrun's rank > 0: no terminal of its own
                return
            run_chat(config, options, sampling, system, chat_template_option(chat_template))


def run_chat(config: Any, options: list[str], sampling: SamplingParams,
             system: str | None, chat_template: str | None = None) -> None:
    from plugserve.engine import Engine
    from plugserve.model.chat_template import ChatTemplateError

    interactive = sys.stdin is not None and sys.stdin.isatty()
    engine = Engine(config, plugins=tuple(options))
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    try:
        try:
            chat = Chat(engine, sampling, system)
        except ChatTemplateError as exc:
            raise UsageError(str(exc)) from None
        if interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (input() gets history and line editing)
            note(f"chat on {engine.config.model or 'the default model'}; commands: {COMMANDS}")
        while True:
            line = _read_line("> " if interactive else "")
            if line is None or line.strip() in ("/quit", "/exit"):
                break
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = {"/undo": chat.undo, "/reset": chat.reset, "/stats": chat.stats_line}
                action = command.get(text.split()[0])
                note(action() if action else f"unknown command {text!r}; commands: {COMMANDS}")
                continue
            try:
                error = chat.turn(text, lambda s: typer.echo(s, nl=False))
            except ChatTemplateError as exc:
                chat.messages.pop()
                error = str(exc)
            if error is not None:
                note(f"error: {error} (/undo or /reset to make room)"
                     if "context holds" in error else f"error: {error}")
        chat.close()
        engine.step()  # nothing left: it settles (the checker's idle check, session closed)
    finally:
        engine.close()


def note(text: str) -> None:
    typer.echo(text, err=True)


def _read_line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None
    except KeyboardInterrupt:
        note("")
        return None
