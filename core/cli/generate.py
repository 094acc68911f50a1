"""`plugserve generate`: run prompts through one engine, print the text and per-request stats."""

from __future__ import annotations

import sys
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
    DraftModelOpt,
    DtypeOpt,
    JsonOpt,
    KVCacheDtypeOpt,
    LogLevelOpt,
    MemCheckOpt,
    ModelOpt,
    PageSizeOpt,
    PluginOpt,
    QuantActivationsOpt,
    QuantizationOpt,
    SpecDraftTokensOpt,
    SpecOpt,
    SpecStepsOpt,
    SpecTopkOpt,
    TpBackendOpt,
    TpOpt,
    chat_template_option,
    checked_plugin_host,
    engine_config,
    followed_rank_0,
    print_json,
    stderr_console,
)

if TYPE_CHECKING:
    from plugserve.config import EngineConfig


def generate_command(
    prompt: Annotated[
        list[str] | None,
        typer.Argument(help="Prompt(s); each is one request. Read from stdin when none."),
    ] = None,
    model: ModelOpt = None,
    plugin: PluginOpt = None,
    attention: AttentionOpt = None,
    spec: SpecOpt = None,
    cache: CacheOpt = None,
    page_size: PageSizeOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="-1 = off.")] = -1,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    ignore_eos: Annotated[
        bool, typer.Option(help="Keep generating past EOS: exactly --max-new-tokens tokens "
                           "per prompt (unless the context ends first).")
    ] = False,
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the chat template.")] = False,
    chat_template: ChatTemplateOpt = None,
    json_out: JsonOpt = False,
    mem_check: MemCheckOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KVCacheDtypeOpt = None,
    quantization: QuantizationOpt = None,
    quant_activations: QuantActivationsOpt = None,
    device: DeviceOpt = None,
    draft_model: DraftModelOpt = None,
    spec_steps: SpecStepsOpt = None,
    spec_topk: SpecTopkOpt = None,
    spec_draft_tokens: SpecDraftTokensOpt = None,
    tp: TpOpt = None,
    tp_backend: TpBackendOpt = None,
    log_level: LogLevelOpt = "WARNING",
    debug: DebugOpt = False,
) -> None:
    """Generate text for one or more prompts and print per-request stats."""
    with reported_errors(debug):
        from plugserve.sampling import SamplingParams

        config = engine_config(
            model=model,
            attention=attention,
            spec=spec,
            cache=cache,
            page_size=page_size,
            mem_check=mem_check,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization, quant_activations=quant_activations,
            device=device,
            draft_model=draft_model,
            spec_steps=spec_steps,
            spec_topk=spec_topk,
            spec_draft_tokens=spec_draft_tokens,
            tp_size=tp,
            tp_backend=tp_backend,
        )
        with stderr_logging(log_level, config.mem_check):
            options = plugin or []
            checked_plugin_host(options, config, debug)
            if followed_rank_0(config, options):
                return
            template = chat_template_option(chat_template)
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                ignore_eos=ignore_eos,
            )
            problems = sampling.problems(vocab_size=sys.maxsize)
            if problems:
                raise UsageError("invalid sampling options: " + "; ".join(problems))
            prompts = list(prompt or []) or [read_stdin_prompt()]
            results, stats = run_requests(config, options, prompts, sampling, chat, template)
            if json_out:
                print_json(generate_document(config, prompts, results, stats))
            else:
                print_results(prompts, results)
            rejected = [r for r in results if r.error]
            for result in rejected:
                typer.echo(f"error: request {result.index} rejected: {result.error}", err=True)
            if rejected:
                raise typer.Exit(1)


def read_stdin_prompt() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt given: pass PROMPT arguments or pipe the prompt on stdin")
    text = sys.stdin.read().strip()
    if not text:
        raise UsageError("no prompt given: stdin was empty")
    return text


def run_requests(
    config: EngineConfig, options: list[str], prompts: list[str], sampling: Any, chat: bool,
    chat_template: str | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """Start the engine and stream every request, with a progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from plugserve.engine import Engine

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    console = stderr_console()
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as progress:
        task = progress.add_task("loading model", total=None)
        engine = Engine(config, plugins=tuple(options))
        if chat_template is not None:
            engine.tokenizer.chat_template = chat_template
        try:
            total = len(prompts) * sampling.max_new_tokens
            progress.update(task, description="generating tokens", total=total, completed=0)
            results: list[Any] = [None] * len(prompts)
            for event in engine.stream(prompts, sampling, chat=chat):
                progress.advance(task, len(event.token_ids))
                if event.result is not None:
                    results[event.index] = event.result
            stats = engine.stats()
        finally:
            engine.close()
    return results, stats


def print_results(prompts: list[str], results: list[Any]) -> None:
    """Generated text on stdout (as is: no markup); the stats table on stderr."""
    from rich.table import Table

    for result in results:
        if len(results) > 1:
            typer.echo(f"--- [{result.index}] {prompts[result.index][:60]!r}")
        typer.echo(result.text)
    speculative = any("spec_verify_steps" in r.stats for r in results)
    columns = ["#", "prompt tok", "output tok", "finish", "ttft s", "tok/s"]
    if speculative:
        columns += ["spec rounds", "accepted", "accept len"]
    table = Table(*columns, box=None)
    for r in results:
        row = [
            str(r.index),
            str(r.prompt_tokens),
            str(r.output_tokens),
            str(r.finish_reason),
            _num(r.stats.get("ttft_s")),
            _num(r.stats.get("output_tokens_per_s"), 1),
        ]
        if speculative:
            row += [
                str(r.stats.get("spec_verify_steps", "-")),
                str(r.stats.get("spec_accepted_tokens", "-")),
                _num(r.stats.get("spec_accept_len_mean"), 2),
            ]
        table.add_row(*row)
    stderr_console().print(table)


def _num(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def generate_document(
    config: EngineConfig, prompts: list[str], results: list[Any], stats: dict[str, Any]
) -> dict[str, Any]:
    return {
        "config": config.model_dump(mode="json"),
        "results": [
            {
                "index": r.index,
                "prompt": prompts[r.index],
                "text": r.text,
                "token_ids": r.token_ids,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "finish_reason": r.finish_reason,
                "error": r.error,
                "stats": r.stats,
            }
            for r in results
        ],
        "engine_stats": stats,
    }
