"""The request-body size limit: a pure ASGI middleware, answered as an OpenAI 413.

A declared `Content-Length` over the limit is answered before any route runs; a chunked body
is counted as it arrives. Either way the body is read to its end (up to a bound) and thrown
away first, so the client, still sending, reads the 413 instead of a reset connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plugserve.server.errors import APIError

ASGIApp = Callable[..., Any]
_DRAIN_FACTOR = 32  # read at most this many times the limit before giving up on the client


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` (FastAPI re-raises HTTP exceptions met while reading a body)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (f"request body is larger than the server's limit of {limit:,} bytes "
            "(--max-body-bytes / PLUGSERVE_MAX_BODY_BYTES)")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Any = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if declared <= self.max_bytes * _DRAIN_FACTOR:
                await _drain(receive, 0, self.max_bytes * _DRAIN_FACTOR)
            if self.on_error is not None:
                self.on_error(413, "request_too_large", scope.get("path", ""))
            error = APIError(413, too_large_message(self.max_bytes))
            response = JSONResponse(error.document(), status_code=413,
                                    headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, seen, self.max_bytes * _DRAIN_FACTOR)
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Any, seen: int, bound: int) -> None:
    while seen <= bound:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
