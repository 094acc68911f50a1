"""Server-Sent Events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end.

`SSEResponse` streams an async iterator of documents while it listens for the client's
disconnect, whatever ASGI version the server speaks; on a disconnect (or a failed send) it
stops the iterator and calls `on_close`, which aborts the engine requests still running, so
their KV is freed exactly like a finish.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import Response

DONE = b"data: [DONE]\n\n"


def sse_event(document: Any) -> bytes:
    return b"data: " + json.dumps(document, ensure_ascii=False).encode("utf-8") + b"\n\n"


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self, documents: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]
    ) -> None:
        # No body: Response.__init__ would declare "content-length: 0".
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.documents = documents
        self.on_close = on_close
        self.disconnected = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            self.disconnected = True
                            group.cancel_scope.cancel()
                            return

                group.start_soon(watch)
                try:
                    await self._stream(send)
                except OSError:  # the client went away while we sent
                    self.disconnected = True
                group.cancel_scope.cancel()
        finally:
            self.on_close()
            close = getattr(self.documents, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()

    async def _stream(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for document in self.documents:
            await send({"type": "http.response.body", "body": sse_event(document),
                        "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
