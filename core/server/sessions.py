"""Streaming-session routes: `POST /v1/sessions` opens one, `DELETE /v1/sessions/{id}`
closes it (plugserve extension). A completion or chat request with `session_id` is one turn
of it. Both run on the engine thread, between scheduler steps; the handler awaits that (the
event loop keeps serving meanwhile).

Session ids are unguessable (the engine's are uuid4-based). With API keys on, a session is
bound to the key that opened it: another key's turns and closes get the same 404 as an
unknown session.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from pydantic import field_validator

from plugserve.mem.sessions import SessionError
from plugserve.server.engine_loop import EngineLoop, NotServing
from plugserve.server.errors import APIError
from plugserve.server.protocol import Body
from plugserve.server.settings import ServerSettings


class SessionRequest(Body):
    timeout_s: float = 600.0  # closed after this many idle seconds

    @field_validator("timeout_s")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {value}")
        return value


class SessionOwners:
    """Which API key opened each session (None: keys are off)."""

    def __init__(self) -> None:
        self._owner: dict[str, str | None] = {}

    def add(self, session_id: str, key: str | None) -> None:
        self._owner[session_id] = key

    def check(self, session_id: str, key: str | None) -> None:
        """404 for a session another key opened (as if unknown: ids are not confirmed)."""
        if session_id in self._owner and self._owner[session_id] != key:
            raise _not_found(session_id)

    def forget(self, session_id: str) -> None:
        self._owner.pop(session_id, None)


def _not_found(session_id: str) -> APIError:
    return APIError(404, f"unknown or closed session {session_id!r}", param="session_id",
                    code="session_not_found")


def caller_key(request: Request) -> str | None:
    return getattr(request.state, "api_key_id", None)


async def _on_engine(loop: EngineLoop, method: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return await loop.call_method_async(method, *args, **kwargs)
    except NotServing as exc:
        raise APIError(503, str(exc)) from None
    except SessionError as exc:
        message = str(exc)
        if "unknown or closed session" in message:
            raise APIError(404, message, param="session_id", code="session_not_found") from None
        if "turn in progress" in message:
            raise APIError(409, message, param="session_id", code="session_busy") from None
        if "cannot open another session" in message:
            raise APIError(503, message, code="too_many_sessions",
                           headers={"Retry-After": "1"}) from None
        raise APIError(400, message, param="timeout_s" if "timeout" in message else None) \
            from None


def add_session_routes(app: FastAPI, loop: EngineLoop, settings: ServerSettings,
                       owners: SessionOwners) -> None:
    @app.post("/v1/sessions")
    async def open_session(request: Request, body: SessionRequest | None = None
                           ) -> dict[str, Any]:
        timeout_s = (body or SessionRequest()).timeout_s
        sid = await _on_engine(loop, "open_session", timeout_s=timeout_s)
        owners.add(sid, caller_key(request))
        return {"id": sid, "object": "session", "timeout_s": timeout_s}

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(request: Request, session_id: str) -> dict[str, Any]:
        owners.check(session_id, caller_key(request))
        await _on_engine(loop, "close_session", session_id)
        owners.forget(session_id)
        return {"id": session_id, "object": "session", "deleted": True}
