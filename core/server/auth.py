"""API keys: with any configured, every `/v1/*` request (and /tokenize, /detokenize,
/tokenizer_info) needs `Authorization: Bearer KEY` (the scheme in any case, as RFC 7235 has it).

`--api-key` takes one key or several separated by commas; the key a request presented is left
in `scope["state"]["api_key_id"]` (a digest, never the key), so a streaming session is bound
to the key that opened it. A pure ASGI middleware: a request without a valid key is refused
(401) before its body is parsed or validated. `/health` and `/metrics` stay open for probes
and scrapers.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from plugserve.server.errors import APIError

ASGIApp = Callable[..., Any]
GUARDED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


def api_keys(setting: str | None) -> tuple[str, ...]:
    """The keys of `--api-key` / PLUGSERVE_API_KEY (comma-separated; blanks dropped)."""
    return tuple(k.strip() for k in (setting or "").split(",") if k.strip())


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, on_error: Any = None) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys(api_key)]
        self.on_error = on_error

    def _matching(self, header: bytes) -> bytes | None:
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key in self.keys:  # compare with every key: the time says nothing about which
            if hmac.compare_digest(token, key):
                found = key
        return found

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (not self.keys or scope["type"] != "http"
                or not str(scope.get("path", "")).startswith(GUARDED)):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        key = self._matching(given) if given is not None else None
        if key is not None:
            scope.setdefault("state", {})["api_key_id"] = key_id(key.decode())
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
