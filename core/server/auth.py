"""The API key: with one configured, every `/v1/*` request needs `Authorization: Bearer KEY`.

A pure ASGI middleware, so a request without the key is refused (401) before its body is
parsed or validated. `/health` and `/metrics` stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from plugserve.server.errors import APIError

ASGIApp = Callable[..., Any]


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, on_error: Any = None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.on_error = on_error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (self.expected is None or scope["type"] != "http"
                or not str(scope.get("path", "")).startswith("/v1")):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if given is not None and hmac.compare_digest(given.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send the header 'Authorization: Bearer KEY'"
                   if given is None else "invalid API key")
        error = APIError(401, message, code="invalid_api_key")
        if self.on_error is not None:
            self.on_error(401, error.type, scope.get("path", ""))
        response = JSONResponse(error.document(), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
