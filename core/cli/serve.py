"""`plugserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on one engine.

Every engine option of `generate` plus the scheduling and memory ones, and the server's own
(host, port, API key, waiting-queue limit, body limit). Options left out fall back to
`PLUGSERVE_*` variables, then to the defaults. Everything is checked (configuration,
plugins, the port) before the model loads.
"""

from __future__ import annotations

import socket
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
)

if TYPE_CHECKING:
    from plugserve.server.settings import ServerSettings

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ENGINE_PROCESS_DEFAULT = False


def _int(help_text: str) -> Any:
    return typer.Option(help=help_text)


def serve_command(
    model: ModelOpt = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require 'Authorization: Bearer KEY' on /v1/* (or PLUGSERVE_API_KEY)."),
    ] = None,
    max_waiting: Annotated[
        int | None, _int("Queued requests before answering 503 (default 256).")
    ] = None,
    max_body_bytes: Annotated[int | None, _int("Request body limit (default 2 MiB).")] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id for clients (default the model's name).")
    ] = None,
    shutdown_timeout: Annotated[
        float | None, typer.Option(help="Seconds running requests get at shutdown (default 10).")
    ] = None,
    plugin: PluginOpt = None,
    attention: AttentionOpt = None,
    cache: CacheOpt = None,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    spec_steps: SpecStepsOpt = None,
    spec_topk: SpecTopkOpt = None,
    spec_draft_tokens: SpecDraftTokensOpt = None,
    page_size: PageSizeOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KVCacheDtypeOpt = None,
    quantization: QuantizationOpt = None,
    quant_activations: QuantActivationsOpt = None,
    device: DeviceOpt = None,
    seed: Annotated[int | None, _int("Engine seed.")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer folder, if not the model's.")
                         ] = None,
    chat_template: ChatTemplateOpt = None,
    max_logprobs: Annotated[
        int | None, _int("Most logprobs alternatives a request may ask per token (default 20).")
    ] = None,
    grammar_backend: Annotated[
        str | None, typer.Option(help="Grammar backend for structured outputs (default "
                                 "xgrammar).")
    ] = None,
    tool_call_parser: Annotated[
        str | None, typer.Option(help="How tool calls are read from chat output (default "
                                 "hermes).")
    ] = None,
    stream_interval: Annotated[
        int | None, _int("Generated tokens per streamed chunk (default 1: every token at once); "
                         "the first and the last chunk go at once.")
    ] = None,
    max_n: Annotated[
        int | None, _int("Most samples a request may ask per prompt, n and best_of (default 16).")
    ] = None,
    max_running_requests: Annotated[int | None, _int("Request rows (batch size limit).")] = None,
    kv_pool_tokens: Annotated[int | None, _int("KV slots per pool.")] = None,
    context_len: Annotated[int | None, _int("Max tokens per request.")] = None,
    chunked_prefill_size: Annotated[int | None, _int("Prefill tokens per step; 0 = off.")] = None,
    max_prefill_tokens: Annotated[int | None, _int("Prefill token budget per batch.")] = None,
    enable_mixed_chunk: Annotated[
        bool | None, typer.Option("--enable-mixed-chunk/--no-mixed-chunk",
                                  help="Mix decodes into prefill batches.", show_default=False)
    ] = None,
    overlap: Annotated[
        bool | None, typer.Option("--overlap/--no-overlap", help="The overlap event loop.",
                                  show_default=False)
    ] = None,
    mem_check: MemCheckOpt = None,
    check_pages: Annotated[
        bool | None, typer.Option("--check-pages/--no-check-pages",
                                  help="Physical page checks (with --mem-check).",
                                  show_default=False)
    ] = None,
    mem_check_ring_size: Annotated[int | None, _int("Checker ring buffer entries.")] = None,
    tp: TpOpt = None,
    tp_backend: TpBackendOpt = None,
    engine_process: Annotated[
        bool, typer.Option("--engine-process/--no-engine-process",
                           help="Run the engine in a process of its own (HTTP, tokenizing and "
                           "SSE in this one), or in a thread of this process.")
    ] = ENGINE_PROCESS_DEFAULT,
    log_level: LogLevelOpt = "WARNING",
    debug: DebugOpt = False,
) -> None:
    """Serve the OpenAI API (completions, chat completions, models) over HTTP.

    \b
    GET  /v1/models             the served model
    POST /v1/completions        text or token-id prompts; stream with SSE
    POST /v1/chat/completions   the model's chat template
    GET  /health                200 while the engine serves
    GET  /metrics               Prometheus metrics
    SIGINT / SIGTERM stop it: running requests get --shutdown-timeout
    seconds, the rest are aborted, and the engine stops with its memory whole.
    --engine-process runs the engine in a process of its own (HTTP, tokenizing
    and SSE stay in this one).
    """
    with reported_errors(debug):
        from plugserve.server.settings import ServerSettings

        config = engine_config(
            model=model, attention=attention, cache=cache, spec=spec, draft_model=draft_model,
            grammar_backend=grammar_backend,
            spec_steps=spec_steps, spec_topk=spec_topk, spec_draft_tokens=spec_draft_tokens,
            page_size=page_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device,
            quantization=quantization, quant_activations=quant_activations,
            seed=seed, tokenizer=tokenizer,
            max_running_requests=max_running_requests, kv_pool_tokens=kv_pool_tokens,
            context_len=context_len, chunked_prefill_size=chunked_prefill_size,
            max_prefill_tokens=max_prefill_tokens, enable_mixed_chunk=enable_mixed_chunk,
            overlap=overlap, mem_check=mem_check, check_pages=check_pages,
            mem_check_ring_size=mem_check_ring_size, tp_size=tp, tp_backend=tp_backend,
        )
        given = {
            "host": host, "port": port, "api_key": api_key, "max_waiting": max_waiting,
            "max_body_bytes": max_body_bytes, "served_model_name": served_model_name,
            "shutdown_timeout_s": shutdown_timeout, "max_logprobs": max_logprobs,
            "tool_call_parser": tool_call_parser,
            "max_n": max_n, "stream_interval": stream_interval,
        }
        settings = ServerSettings(**{k: v for k, v in given.items() if v is not None})
        with stderr_logging(log_level, config.mem_check):
            options = plugin or []
            checked_plugin_host(options, config, debug)
            if followed_rank_0(config, options):  # torchrun's rank > 0: no HTTP of its own
                return
            template = chat_template_option(chat_template)
            sock = bind(settings)
            try:
                run_server(config, options, settings, sock, log_level, template,
                           engine_process=engine_process)
            finally:
                sock.close()


def bind(settings: ServerSettings) -> socket.socket:
    """The listening socket, bound before the model loads: a busy port costs nothing."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {settings.host}:{settings.port}: "
                         f"{exc.strerror or exc}; choose another --port or --host") from None
    return sock


def run_server(config: Any, options: list[str], settings: ServerSettings,
               sock: socket.socket, log_level: str, chat_template: str | None = None, *,
               engine_process: bool = ENGINE_PROCESS_DEFAULT) -> None:
    import uvicorn

    from plugserve.server.app import create_app

    if settings.host not in LOOPBACK and settings.api_key is None:
        typer.echo(f"warning: serving on {settings.host} without an API key: anyone who can "
                   "reach this port can use the model (--api-key)", err=True)
    engine = _start_engine(config, options, log_level, engine_process)
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    try:
        app = create_app(engine, settings)
        state = app.state.server
        port = sock.getsockname()[1]
        weights_mib = engine.weight_bytes / (1 << 20)
        packs_mib = engine.pack_bytes() / (1 << 20)
        packs = f" + {packs_mib:.1f} MiB of their CPU-kernel packs" if packs_mib else ""
        typer.echo(f"plugserve: serving {state.model_id} on http://{settings.host}:{port}/v1 "
                   f"({weights_mib:.1f} MiB of weights{packs}; Ctrl-C stops)", err=True)
        shutdown = app.state.shutdown
        server = _server_class(uvicorn)(uvicorn.Config(
            app, log_config=None, log_level=log_level.lower(), lifespan="on",
            # The drain (plugserve.server.shutdown) answers every request before uvicorn is
            # told to exit; this bound only covers connections that stay open after that.
            timeout_graceful_shutdown=5, access_log=log_level.upper() in ("DEBUG", "INFO"),
        ), shutdown.on_signal)
        shutdown.request_exit = lambda: setattr(server, "should_exit", True)
        server.run(sockets=[sock])
        loop = app.state.engine_loop
        if loop.failure is not None:
            raise RuntimeError(f"the engine stopped serving after an error: {loop.failure}")
        whole = loop.idle_memory_problem
        aborted = f"{shutdown.aborted} request(s) aborted at shutdown; " if shutdown.aborted \
            else ""
        typer.echo(f"plugserve: stopped; {aborted}memory whole at idle: "
                   + ("yes" if whole is None else f"NO ({whole})"), err=True)
    finally:
        engine.close()


def _start_engine(config: Any, options: list[str], log_level: str, engine_process: bool
                  ) -> Any:
    """The engine here (a thread of this process serves it), or in a process of its own."""
    if engine_process:
        from plugserve.server.engine_process import EngineProcess

        try:
            return EngineProcess(config, tuple(options), log_level=log_level)
        except RuntimeError as exc:
            raise UsageError(str(exc)) from None
    from plugserve.engine import Engine
    from plugserve.model.batch_packs import make_batch_packs

    engine = Engine(config, plugins=tuple(options))
    make_batch_packs(engine.model)
    return engine


def _server_class(uvicorn: Any) -> Any:
    class Server(uvicorn.Server):
        """On SIGINT / SIGTERM the app drains first (`on_signal`: grace period, aborts, then
        `should_exit`); a second signal exits at once. The signal is not re-raised after the
        shutdown (newer uvicorn does): the command reports and exits 0 itself."""

        def __init__(self, config: Any, on_signal: Any) -> None:
            super().__init__(config)
            self.on_signal = on_signal

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.on_signal(sig)

    return Server
