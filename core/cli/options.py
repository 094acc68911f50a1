"""Options shared by the commands (typer aliases) and the set-up every engine command does
before anything heavy loads: the config, the plugins, the console."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from plugserve.cli.errors import UsageError

if TYPE_CHECKING:
    from plugserve.config import EngineConfig
    from plugserve.plugins import PluginHost


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
KVCacheDtypeOpt = Annotated[
    str | None,
    typer.Option(help="What the KV cache stores: auto (the model's dtype), float32, bfloat16, "
                 "float8_e4m3 or float8_e5m2."),
]
QuantizationOpt = Annotated[
    str | None,
    typer.Option(help="Weights: q8_0, q4_0 or q4_k quantize an HF folder's matrices on load; "
                 "none dequantizes a GGUF; unset keeps what the model stores."),
]
QuantActivationsOpt = Annotated[
    str | None,
    typer.Option(help="Input of quantized matmuls: int8 (per 32-block, as llama.cpp; the "
                 "default) or float (the compute dtype)."),
]
MemCheckOpt = Annotated[
    int | None,
    typer.Option(
        help="KV invariant checker level: 0 off, 1 quiet, 2 verbose (every step's terms "
        "on stderr, whatever --log-level says)."
    ),
]
DraftModelOpt = Annotated[str | None, typer.Option(help="Draft model folder for --spec.")]
SpecStepsOpt = Annotated[int | None, typer.Option(help="Draft steps per verify.")]
SpecTopkOpt = Annotated[int | None, typer.Option(help="Draft branches per step (1 = chain).")]
SpecDraftTokensOpt = Annotated[int | None, typer.Option(help="Tree nodes sent to verify.")]
TpOpt = Annotated[
    int | None,
    typer.Option(
        "--tp",
        metavar="N",
        help="Tensor-parallel ranks: the engine starts N-1 more on this machine, or, under "
        "torchrun, joins its ranks (PLUGSERVE_TP_SIZE).",
    ),
]
TpBackendOpt = Annotated[
    str | None,
    typer.Option("--tp-backend", help="torch.distributed backend of the model's collectives: "
                 "gloo (CPU default) or nccl (CUDA default)."),
]
LogLevelOpt = Annotated[
    str,
    typer.Option(
        "--log-level",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR: log records of this level and above go to stderr.",
    ),
]
ChatTemplateOpt = Annotated[
    str | None,
    typer.Option(metavar="PATH_OR_TEXT",
                 help="Chat template (a Jinja file or the text) instead of the model's."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")]


def engine_config(**values: Any) -> EngineConfig:
    """EngineConfig from the options given; options left out fall back to PLUGSERVE_* / defaults."""
    from plugserve.config import EngineConfig

    return EngineConfig(**{k: v for k, v in values.items() if v is not None})


def followed_rank_0(config: EngineConfig, options: list[str]) -> bool:
    """Under torchrun, a rank > 0 of a tensor-parallel command serves rank 0's engine instead
    of running the command itself (no prompt, no port, no output); True once rank 0 closed."""
    from plugserve.parallel import is_follower_rank

    if config.tp_size <= 1 or not is_follower_rank():
        return False
    from plugserve.engine import Engine

    Engine.run_follower(config, plugins=tuple(options))
    return True


def checked_plugin_host(options: list[str], config: EngineConfig, debug: bool) -> PluginHost:
    """Load the selected plugins, warn about broken ones, refuse an unsupported config.

    Runs before any model is loaded, so every configuration error costs nothing.
    """
    from plugserve.plugins import load_plugins
    from plugserve.validation import validate_config

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


def chat_template_option(value: str | None) -> str | None:
    """`--chat-template` read and compiled before the model loads (a usage error otherwise)."""
    if value is None:
        return None
    from plugserve.cli.errors import UsageError
    from plugserve.model.chat_template import ChatTemplateError, load_chat_template

    try:
        return load_chat_template(value)
    except ChatTemplateError as exc:
        raise UsageError(str(exc)) from None
