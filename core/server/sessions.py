"""Streaming-session routes: `POST /v1/sessions` opens one, `DELETE /v1/sessions/{id}`
closes it (plugserve extension). A completion or chat request with `session_id` is one turn
of it. Both run on the engine thread, between scheduler steps."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from plugserve.mem.sessions import SessionError
from plugserve.server.engine_loop import EngineLoop
from plugserve.server.errors import APIError
from plugserve.server.protocol import Body


class SessionRequest(Body):
    timeout_s: float = 600.0  # closed after this many idle seconds


def _on_engine(loop: EngineLoop, fn: Any) -> Any:
    try:
        return loop.call(fn)
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


def add_session_routes(app: FastAPI, loop: EngineLoop) -> None:
    @app.post("/v1/sessions")
    async def open_session(body: SessionRequest | None = None) -> dict[str, Any]:
        timeout_s = (body or SessionRequest()).timeout_s
        sid = _on_engine(loop, lambda engine: engine.open_session(timeout_s=timeout_s))
        return {"id": sid, "object": "session", "timeout_s": timeout_s}

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str) -> dict[str, Any]:
        _on_engine(loop, lambda engine: engine.close_session(session_id))
        return {"id": session_id, "object": "session", "deleted": True}
