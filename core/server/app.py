"""`create_app(engine, settings)`: the FastAPI application of `plugserve serve`.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST
/v1/chat/completions, POST /v1/sessions, DELETE /v1/sessions/{id}, POST /tokenize, POST
/detokenize, GET /tokenizer_info, GET /health, GET /metrics. The lifespan starts the engine
thread and, at shutdown, stops it. A shutdown first drains (`plugserve.server.shutdown`):
running requests get `settings.shutdown_timeout_s`, the rest are aborted with a last chunk or
a 503, then uvicorn exits and the engine goes idle with its memory whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from plugserve.server.auth import ApiKeyGuard
from plugserve.server.engine_loop import EngineLoop
from plugserve.server.errors import install_error_handlers, log
from plugserve.server.handlers import ServerState
from plugserve.server.limits import BodyLimit
from plugserve.server.metrics import CONTENT_TYPE, ServerMetrics
from plugserve.server.output import Documents
from plugserve.server.protocol import ChatCompletionRequest, CompletionRequest
from plugserve.server.sampling import chat_generation, completion_generation
from plugserve.server.sessions import add_session_routes
from plugserve.server.settings import ServerSettings, served_model_id
from plugserve.server.shutdown import GracefulShutdown
from plugserve.server.tokenize import add_tokenizer_routes
from plugserve.server.tool_output import tool_mode


def _serving_loop(engine: Any, settings: ServerSettings, metrics: ServerMetrics) -> Any:
    """The engine thread in this process, or the engine process's side of its pipe."""
    from plugserve.server.engine_process import EngineProcess

    if isinstance(engine, EngineProcess):
        return engine.attach(max_waiting=settings.max_waiting, metrics=metrics)
    return EngineLoop(engine, max_waiting=settings.max_waiting, metrics=metrics)


def create_app(engine: Any, settings: ServerSettings | None = None) -> FastAPI:
    """The app serving `engine` (an Engine, or an EngineProcess: the engine in a process of
    its own). The engine must not be used by anyone else meanwhile: from the lifespan's start
    to its end only the engine thread touches it."""
    settings = settings or ServerSettings()
    model_path = engine.config.model
    model_id = served_model_id(model_path, settings.served_model_name)
    metrics = ServerMetrics(model_id)
    metrics.weight_bytes.set(engine.weight_bytes)
    pack_bytes = engine.pack_bytes()  # asked here: from the lifespan on the engine is busy
    metrics.weight_pack_bytes.set(pack_bytes)
    loop = _serving_loop(engine, settings, metrics)
    state = ServerState(loop, settings, model_id, aliases=(model_path,) if model_path else ())
    shutdown = GracefulShutdown(state, settings.shutdown_timeout_s)
    created = int(time.time())
    # An unknown --tool-call-parser stops start-up with the registered names.
    tool_parser = engine.host.registries.tool_parsers.get(settings.tool_call_parser).load()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        shutdown.loop = asyncio.get_running_loop()
        metrics.serving_started()
        loop.start()
        metrics.set_engine_up(True)
        log.info("serving %s (context %d tokens, weights %.1f MiB, their CPU-kernel packs "
                 "%.1f MiB)", model_id, loop.context_len, engine.weight_bytes / (1 << 20),
                 pack_bytes / (1 << 20))
        try:
            yield
        finally:
            # uvicorn already gave running requests their time (timeout_graceful_shutdown);
            # what still runs has no client left: abort it now.
            await asyncio.to_thread(loop.stop, 0.0)
            metrics.set_engine_up(False)
            log.info("engine stopped; memory whole at idle: %s",
                     "yes" if loop.idle_memory_problem is None else loop.idle_memory_problem)

    app = FastAPI(title="plugserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.state.engine_loop = loop
    app.state.metrics = metrics
    app.state.shutdown = shutdown
    install_error_handlers(app, metrics.http_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, on_error=metrics.http_error)
    app.add_middleware(ApiKeyGuard, api_key=settings.api_key, on_error=metrics.http_error)

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "plugserve",
                "root": model_path or model_id, "max_model_len": loop.context_len,
                "vocab_size": loop.vocab_size}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        state.check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        state.check_model(body.model)
        gen = completion_generation(body, state.tokenizer, settings.max_logprobs)
        docs = Documents("completion", model_id, state.tokenizer.decode,
                         logprobs=body.logprobs is not None, token_ids=body.return_token_ids,
                         echo=body.echo, prompt_logprobs=body.prompt_logprobs is not None,
                         skip_special_tokens=body.skip_special_tokens)
        return await state.respond(request, gen, docs, stream=body.stream,
                                   include_usage=body.include_usage, stop=body.stop_strings,
                                   arrival_s=arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        state.check_model(body.model)
        gen = chat_generation(body, state.tokenizer, loop.context_len, settings.max_logprobs)
        docs = Documents("chat", model_id, state.tokenizer.decode, logprobs=body.logprobs,
                         token_ids=body.return_token_ids,
                         prompt_logprobs=body.prompt_logprobs is not None,
                         skip_special_tokens=body.skip_special_tokens,
                         tools=tool_mode(body, tool_parser))
        return await state.respond(request, gen, docs, stream=body.stream,
                                   include_usage=body.include_usage, stop=body.stop_strings,
                                   arrival_s=arrival)

    add_session_routes(app, loop, settings, state.session_owners)
    add_tokenizer_routes(app, state)

    @app.get("/health")
    async def health() -> JSONResponse:
        rank_problem = loop.rank_problem()  # a tensor-parallel rank that died
        alive = loop.alive and rank_problem is None
        document = {
            "status": "shutting_down" if state.draining else "ok" if alive
            else "unavailable",
            "model": model_id,
            "running": loop.running(),
            "waiting": loop.waiting(),
            "idle_checks": loop.idle_checks,
            "memory_whole_at_idle": loop.idle_memory_problem is None,
            "memory_problem": loop.idle_memory_problem,
            "engine_error": None if loop.failure is None else type(loop.failure).__name__,
            "rank_problem": rank_problem,
        }
        up = alive and not state.draining
        return JSONResponse(document, status_code=200 if up else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.set_engine_up(loop.alive)
        metrics.running.set(loop.running())
        metrics.waiting.set(loop.waiting())
        metrics.loop_times(dict(loop.time_s))
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
