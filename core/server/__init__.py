"""`plugserve serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) around one engine.

settings     ServerSettings: host, port, API key, max waiting, body limit (PLUGSERVE_*)
protocol     pydantic request bodies (completions, chat completions)
sampling     a request body -> prompts (token ids) and SamplingParams, with OpenAI checks
engine_loop  the engine thread: submissions and aborts through a queue, tokens to asyncio
jobs         an HTTP request as engine requests (handles) and the events they receive
output       incremental detokenization and the OpenAI response / chunk documents
logprob_docs logprobs as OpenAI / vLLM documents (completions, chat, prompt_logprobs)
sse          the Server-Sent Events response that aborts its request on disconnect
sessions     the session routes (awaited on the engine thread; ids bound to API keys)
tokenize     /tokenize, /detokenize, /tokenizer_info (vLLM's shapes)
shutdown     the graceful drain on SIGINT / SIGTERM (grace, aborts, then exit)
errors       OpenAI-shaped error documents and the exception handlers
auth         API keys (several, any-case Bearer scheme), as an ASGI middleware
limits       the request-body size limit (ASGI middleware)
metrics      Prometheus metrics, one CollectorRegistry per server
app          create_app(): the routes and the lifespan (engine thread start / stop)
background   BackgroundServer: uvicorn in a thread on a loopback port (tests, soak, bench)

Nothing here is imported by the engine; `plugserve --help` never imports FastAPI.
"""

from __future__ import annotations
