"""The `plugserve` command line: generate, plugins, bench.

Nothing heavy is imported at module level: torch, the engine and the plugins load inside the
command that needs them, so `plugserve --help` works even with a broken plugin installed.
Every error a user can cause ends as one line on stderr and exit code 1; `--debug` adds the
traceback.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from plugserve.config import EngineConfig
    from plugserve.plugins import PluginHost

app = typer.Typer(
    name="plugserve",
    help="A small, pluggable LLM inference engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

PluginOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--plugin",
        "-p",
        metavar="NAME|no:NAME",
        help="Load plugin NAME even outside PLUGSERVE_PLUGINS, or block it with no:NAME. "
        "Repeatable.",
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="HF model folder or .gguf file; the built-in SmolLM2-135M when left out.",
    ),
]
AttentionOpt = Annotated[str | None, typer.Option(help="Attention backend by name.")]
CacheOpt = Annotated[str | None, typer.Option(help="Prefix-cache policy by name.")]
SpecOpt = Annotated[str | None, typer.Option(help="Speculative algorithm by name (none = off).")]
PageSizeOpt = Annotated[int | None, typer.Option(help="KV page size in tokens.")]
DtypeOpt = Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu or cuda[:N].")]
MemCheckOpt = Annotated[
    int | None, typer.Option(help="KV invariant checker level: 0 off, 1 quiet, 2 verbose.")
]
DraftModelOpt = Annotated[str | None, typer.Option(help="Draft model folder for --spec.")]
SpecStepsOpt = Annotated[int | None, typer.Option(help="Draft steps per verify.")]
SpecTopkOpt = Annotated[int | None, typer.Option(help="Draft branches per step (1 = chain).")]
SpecDraftTokensOpt = Annotated[int | None, typer.Option(help="Tree nodes sent to verify.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")]


def main() -> None:
    """Console script entry point."""
    app(prog_name="plugserve")


# --- errors ---------------------------------------------------------------------------------


_BULLET = re.compile(r"^[-*•]\s+")


def one_line(text: str) -> str:
    """Join a multi-line message (e.g. a bulleted list of reasons) into one line."""
    parts = [_BULLET.sub("", line.strip()) for line in str(text).splitlines()]
    parts = [part for part in parts if part]
    if not parts:
        return ""
    head, rest = parts[0], parts[1:]
    if not rest:
        return head
    sep = " " if head.endswith(":") else "; "
    return head + sep + "; ".join(rest)


def describe_error(exc: BaseException) -> str:
    """One line a user can act on; unexpected errors say where to find more."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "invalid configuration: " + "; ".join(_pydantic_issue(e) for e in exc.errors())
    if _is_user_error(exc):
        return one_line(str(exc))
    return f"{type(exc).__name__}: {one_line(str(exc))} (run with --debug for the traceback)"


def _pydantic_issue(error: Any) -> str:
    msg = str(error.get("msg", "")).removeprefix("Value error, ")
    loc = ".".join(str(part) for part in error.get("loc", ()))
    return f"{loc}={error.get('input')!r}: {msg}" if loc else msg


def _is_user_error(exc: BaseException) -> bool:
    from plugserve.model.errors import ModelLoadError
    from plugserve.plugins import PluginError
    from plugserve.registry import RegistryError

    known: tuple[type[BaseException], ...] = (
        PluginError,
        RegistryError,
        ModelLoadError,
        UsageError,
    )
    if isinstance(exc, known):
        return True
    return type(exc).__name__ == "EngineStartError"


class UsageError(ValueError):
    """A bad command-line value that only the command itself can judge."""


@contextmanager
def reported_errors(debug: bool) -> Iterator[None]:
    """Turn any error into one stderr line and exit code 1 (the traceback too with --debug)."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug:
            traceback.print_exc(file=sys.stderr)
        typer.echo(f"error: {describe_error(exc)}", err=True)
        raise typer.Exit(1) from None


# --- shared set-up ----------------------------------------------------------------------------


def engine_config(**values: Any) -> EngineConfig:
    """EngineConfig from the options given; options left out fall back to PLUGSERVE_* / defaults."""
    from plugserve.config import EngineConfig

    return EngineConfig(**{k: v for k, v in values.items() if v is not None})


def checked_plugin_host(options: list[str], config: EngineConfig, debug: bool) -> PluginHost:
    """Load the selected plugins, warn about broken ones, refuse an unsupported config.

    Runs before any model is loaded, so every configuration error costs nothing.
    """
    from plugserve.plugins import load_plugins
    from plugserve.registry import validate_config

    host = load_plugins(options, allowlist=config.plugins)
    warn_failures(host, debug)
    reasons = validate_config(config, host.registries)
    if reasons:
        raise UsageError("unsupported configuration: " + "; ".join(reasons))
    return host


def warn_failures(host: PluginHost, debug: bool) -> None:
    for failure in host.failures:
        if debug and failure.detail:
            typer.echo(failure.detail.rstrip(), err=True)
        typer.echo(f"warning: {failure.message()}; it is not loaded", err=True)


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def print_json(document: Any) -> None:
    typer.echo(json.dumps(document, indent=2, default=str))


# --- commands ---------------------------------------------------------------------------------


@app.command()
def generate(
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
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the chat template.")] = False,
    json_out: JsonOpt = False,
    mem_check: MemCheckOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    draft_model: DraftModelOpt = None,
    spec_steps: SpecStepsOpt = None,
    spec_topk: SpecTopkOpt = None,
    spec_draft_tokens: SpecDraftTokensOpt = None,
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
            device=device,
            draft_model=draft_model,
            spec_steps=spec_steps,
            spec_topk=spec_topk,
            spec_draft_tokens=spec_draft_tokens,
        )
        options = plugin or []
        checked_plugin_host(options, config, debug)
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
        )
        problems = sampling.problems(vocab_size=sys.maxsize)
        if problems:
            raise UsageError("invalid sampling options: " + "; ".join(problems))
        prompts = list(prompt or []) or [read_stdin_prompt()]
        results, stats = run_requests(config, options, prompts, sampling, chat)
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
    config: EngineConfig, options: list[str], prompts: list[str], sampling: Any, chat: bool
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


@app.command()
def plugins(
    all_: Annotated[
        bool, typer.Option("--all", help="Also list installed plugins that were not loaded.")
    ] = False,
    json_out: JsonOpt = False,
    plugin: PluginOpt = None,
    debug: DebugOpt = False,
) -> None:
    """List plugins: what each registers, its capabilities, and the ones that failed."""
    with reported_errors(debug):
        from plugserve.plugins import load_plugins

        host = load_plugins(plugin or [], strict=False)
        document = plugins_document(host, include_skipped=all_)
        if json_out:
            print_json(document)
        else:
            print_plugins(document)
        if debug:
            for failure in host.failures:
                if failure.detail:
                    typer.echo(failure.detail.rstrip(), err=True)
        host.raise_for_conflicts()


def plugins_document(host: PluginHost, *, include_skipped: bool) -> dict[str, Any]:
    from plugserve.registry import PAGE_TREE_WHITELIST

    entries = host.registries.all_entries()
    rows: list[dict[str, Any]] = []
    for info in host.plugins:
        own = [e for e in entries if e.plugin == info.name]
        rows.append(
            {
                "name": info.name,
                "status": "loaded",
                "distribution": info.distribution,
                "version": info.version,
                "module": info.module,
                "kinds": sorted({e.kind for e in own}),
                "hooks": info.hooks,
                "registers": [
                    {
                        "kind": e.kind,
                        "name": e.name,
                        "description": e.description,
                        "capabilities": e.capabilities_dict(),
                        **(
                            {"page_tree_whitelisted": e.name in PAGE_TREE_WHITELIST}
                            if e.kind == "attention backend"
                            else {}
                        ),
                    }
                    for e in own
                ],
            }
        )
    for failure in host.failures:
        rows.append(
            {
                "name": failure.name,
                "status": "failed",
                "distribution": failure.distribution,
                "stage": failure.stage,
                "error": failure.error,
            }
        )
    if include_skipped:
        for skipped in host.skipped:
            rows.append(
                {
                    "name": skipped.name,
                    "status": "skipped",
                    "distribution": skipped.distribution,
                    "version": skipped.version,
                    "reason": skipped.reason,
                }
            )
    return {
        "plugins": rows,
        "page_tree_whitelist": list(PAGE_TREE_WHITELIST),
        "conflicts": list(host.conflicts),
    }


def print_plugins(document: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    plugins_table = Table("plugin", "distribution", "version", "status", "hooks", title="plugins")
    registered = Table("kind", "name", "plugin", "capabilities", "description", title="registered")
    for row in document["plugins"]:
        status = {
            "loaded": "[green]loaded[/]",
            "failed": f"[red]failed at {row.get('stage')}: {escape(str(row.get('error')))}[/]",
            "skipped": f"[yellow]not loaded: {escape(str(row.get('reason')))}[/]",
        }[row["status"]]
        hooks = "\n".join(h.removeprefix("plugserve_") for h in row.get("hooks", []))
        plugins_table.add_row(
            row["name"], row["distribution"] or "-", row.get("version", "-"), status, hooks
        )
        for entry in row.get("registers", []):
            caps = ", ".join(f"{k}={_cap(v)}" for k, v in entry["capabilities"].items())
            if "page_tree_whitelisted" in entry:
                caps += f", page_tree_whitelist={'yes' if entry['page_tree_whitelisted'] else 'no'}"
            registered.add_row(
                entry["kind"],
                entry["name"],
                row["name"],
                escape(caps),
                escape(entry["description"]),
            )
    console.print(plugins_table)
    console.print(registered)
    console.print(
        "page_size>1 with topk>1 is allowed only for: " + ", ".join(document["page_tree_whitelist"])
    )


def _cap(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "|".join(str(v) for v in value)
    return str(value)


WORKLOAD_OPTIONS: dict[str, tuple[str, ...]] = {
    # workload -> its own options (each refused by the others)
    "throughput": ("num_seqs", "max_input_len", "max_output_len", "seed"),
    "shared-prefix": (
        "groups", "prompts_per_group", "prefix_len", "question_len", "output_len", "seed",
    ),
    "spec": ("spec_prompts", "output_len"),
}


@app.command()
def bench(
    workload: Annotated[
        str,
        typer.Argument(
            metavar="WORKLOAD",
            help="throughput (default), shared-prefix or spec.",
            show_default=False,
        ),
    ] = "throughput",
    model: ModelOpt = None,
    plugin: PluginOpt = None,
    attention: AttentionOpt = None,
    cache: CacheOpt = None,
    page_size: PageSizeOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    mem_check: MemCheckOpt = None,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    spec_steps: SpecStepsOpt = None,
    spec_topk: SpecTopkOpt = None,
    spec_draft_tokens: SpecDraftTokensOpt = None,
    num_seqs: Annotated[
        int | None, typer.Option(help="throughput: requests in the workload (default 64).")
    ] = None,
    max_input_len: Annotated[
        int | None,
        typer.Option(help="throughput: longest prompt (tokens, >= 16) (default 256)."),
    ] = None,
    max_output_len: Annotated[
        int | None,
        typer.Option(help="throughput: longest output (tokens, >= 16) (default 256)."),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="throughput, shared-prefix: workload seed (default 0).")
    ] = None,
    groups: Annotated[
        int | None, typer.Option(help="shared-prefix: groups G (default 8).")
    ] = None,
    prompts_per_group: Annotated[
        int | None, typer.Option(help="shared-prefix: prompts per group P (default 8).")
    ] = None,
    prefix_len: Annotated[
        int | None,
        typer.Option(help="shared-prefix: shared prefix tokens S (default 512)."),
    ] = None,
    question_len: Annotated[
        int | None, typer.Option(help="shared-prefix: question tokens Q (default 32).")
    ] = None,
    output_len: Annotated[
        int | None,
        typer.Option(help="shared-prefix: output tokens O (default 32); spec: new tokens "
                     "N (default 64)."),
    ] = None,
    spec_prompts: Annotated[
        int | None, typer.Option(help="spec: chat prompts used (default 8).")
    ] = None,
    compare: Annotated[
        str | None, typer.Option(help="Also time another implementation: transformers.")
    ] = None,
    hf_batch_sizes: Annotated[
        str, typer.Option(help="Batch sizes tried for transformers; the best counts.")
    ] = "16,32,64",
    plot: Annotated[
        Path | None,
        typer.Option(metavar="FILE.png", help="Write a bar chart of the main figures."),
    ] = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Offline benchmark of one workload (greedy, EOS ignored), with serving metrics.

    \b
    throughput     random prompts and output lengths, all at once (64 seqs:
                   9,536 prompt / 8,224 output tokens)
    shared-prefix  G groups x P prompts, each a shared S-token prefix + a Q-token
                   question; run with the radix cache and without
    spec           chat prompts; plain vs EAGLE chain (3 steps) vs tree (topk 4,
                   8 tokens), page size 1 and 16, batch 1 and 8; needs a draft
                   model (--draft-model) unless the engine ships one

    \b
    Every run reports req/s, input and output tok/s, and
    TTFT  time to first token: mean, median, p99
    ITL   gaps between a request's successive tokens: mean, median, p95,
          p99; tokens of one speculative verify round arrive together,
          a gap of 0
    TPOT  (latency - TTFT) / (output tokens - 1) per request: mean
    step time by phase (schedule, metadata, forward, sample, post-process,
    check, and draft/verify/accept/draft_extend with speculation).
    spec adds the acceptance length (tokens per verify round) and target
    forwards per output token ((1 prefill + verify rounds) / output tokens;
    1.0 without speculation).
    """
    with reported_errors(debug):
        from plugserve.bench.hf import Comparison
        from plugserve.bench.runner import Runner
        from plugserve.bench.workloads import get_workload
        from plugserve.registry import validate_config

        try:
            chosen = get_workload(workload)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        engine_values: dict[str, Any] = {
            "cache": cache,
            "page_size": page_size,
            "spec": spec,
            "spec_steps": spec_steps,
            "spec_topk": spec_topk,
            "spec_draft_tokens": spec_draft_tokens,
        }
        workload_values: dict[str, Any] = {
            "num_seqs": num_seqs,
            "max_input_len": max_input_len,
            "max_output_len": max_output_len,
            "seed": seed,
            "groups": groups,
            "prompts_per_group": prompts_per_group,
            "prefix_len": prefix_len,
            "question_len": question_len,
            "output_len": output_len,
            "spec_prompts": spec_prompts,
        }
        refuse_foreign_options(chosen.name, chosen.engine_fields_set, engine_values,
                               workload_values)
        # The spec workload turns speculation on and off itself: its draft model is a
        # workload option, not part of the base engine config.
        spec_draft_model = draft_model if chosen.name == "spec" else None
        if spec_draft_model is not None:
            draft_model = None
        config = engine_config(
            model=model,
            attention=attention,
            dtype=dtype,
            device=device,
            mem_check=mem_check,
            draft_model=draft_model,
            **engine_values,
        )
        options = plugin or []
        host = checked_plugin_host(options, config, debug)
        if compare not in (None, "transformers"):
            raise UsageError(f"--compare {compare!r} is not supported; allowed: transformers")
        try:
            batch_sizes = tuple(int(part) for part in hf_batch_sizes.split(",") if part.strip())
        except ValueError:
            raise UsageError(
                f"--hf-batch-sizes must be comma-separated integers, got {hf_batch_sizes!r}"
            ) from None
        try:
            workload_options = bench_workload_options(chosen.name, workload_values)
            if spec_draft_model is not None:
                workload_options = dataclasses.replace(workload_options,
                                                       draft_model=spec_draft_model)
            comparison = Comparison(batch_sizes) if compare == "transformers" else None
        except ValueError as exc:
            raise UsageError(f"invalid benchmark options: {exc}") from None
        for label, derived in chosen.engine_configs(config, workload_options).items():
            reasons = validate_config(derived, host.registries)
            if reasons:
                raise UsageError(
                    f"unsupported configuration for {chosen.name} run {label!r}: "
                    + "; ".join(reasons)
                )
        runner = Runner(config, tuple(options), console=stderr_console(),
                        show_progress=not json_out)
        with runner.session():
            report = chosen.run(runner, workload_options, comparison)
        if plot is not None:
            from plugserve.bench.plot import write_plot

            report["plot"] = str(write_plot(report, plot))
        if json_out:
            print_json(report)
        else:
            from plugserve.bench.report import print_report

            print_report(report)
            if plot is not None:
                typer.echo(f"plot written to {report['plot']}", err=True)


def refuse_foreign_options(
    workload: str,
    engine_fields_set: tuple[str, ...],
    engine_values: dict[str, Any],
    workload_values: dict[str, Any],
) -> None:
    """Options the chosen workload would ignore or override are errors, not silent no-ops."""
    flag = "--{}".format
    overridden = [flag(k.replace("_", "-")) for k in engine_fields_set
                  if engine_values.get(k) is not None]
    if overridden:
        raise UsageError(
            f"bench {workload} chooses {', '.join(overridden)} itself; leave "
            f"{'it' if len(overridden) == 1 else 'them'} out"
        )
    own = WORKLOAD_OPTIONS[workload]
    foreign = [flag(k.replace("_", "-")) for k, v in workload_values.items()
               if v is not None and k not in own]
    if foreign:
        raise UsageError(
            f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to bench "
            f"{workload}; its options: {', '.join(flag(k.replace('_', '-')) for k in own)}"
        )


def bench_workload_options(workload: str, values: dict[str, Any]) -> Any:
    """The workload's options dataclass from the options given (defaults for the rest)."""
    from plugserve.bench.shared_prefix import SharedPrefixOptions
    from plugserve.bench.spec import SpecOptions
    from plugserve.bench.throughput import ThroughputOptions

    given = {k: v for k, v in values.items() if v is not None}
    if workload == "throughput":
        return ThroughputOptions(**given)
    if workload == "shared-prefix":
        return SharedPrefixOptions(**given)
    if "spec_prompts" in given:
        given["num_prompts"] = given.pop("spec_prompts")
    return SpecOptions(**given)
