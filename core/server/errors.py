"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every way a request can fail ends here: a body pydantic refuses (400, malformed JSON
included), a value the engine refuses (400; 413 for a prompt over the context), a missing or
wrong key (401), an unknown model or route (404), a body over the limit (413), a full queue
(503 with Retry-After). An unexpected error is logged with its traceback on the server and
answered with a 500 that names only its type: a client never sees a traceback.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("plugserve.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    500: "internal_error",
    503: "overloaded_error",
}
# Engine messages start with the field they are about; the OpenAI name of that field.
_ENGINE_PARAMS = {
    "max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop", "prompt": "prompt",
    "request": "max_tokens", "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias", "min_tokens": "min_tokens", "top_logprobs": "top_logprobs",
    "prompt_logprobs": "prompt_logprobs", "stop_token_ids": "stop_token_ids",
    "unknown": "stop_token_ids",
}


class APIError(Exception):
    """An error answered as an OpenAI error document."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def document(self) -> dict[str, Any]:
        return error_document(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.document(), status_code=self.status, headers=self.headers)


def error_document(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def engine_rejection(error: str, prompt_tokens: int, context_len: int) -> APIError:
    """The engine refused a request (`Req.error`): 413 for a prompt over the context, else 400."""
    first = re.match(r"\w+", error)
    param = _ENGINE_PARAMS.get(first.group(0)) if first else None
    if "unknown or closed session" in error:
        return APIError(404, error, param="session_id", code="session_not_found")
    if "session" in error:
        param = "session_offset" if "session_offset" in error else "session_id"
    if prompt_tokens >= context_len or "the context holds" in error:
        return APIError(413, error, param="prompt", code="context_length_exceeded")
    return APIError(400, error, param=param)


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One line from pydantic's errors, and the first offending field."""
    parts: list[str] = []
    param: str | None = None
    for err in errors[:4]:
        kind = err.get("type", "")
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if kind == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "invalid JSON")
            where = f" at character {loc[0]}" if loc else ""
            return f"malformed JSON body: {reason}{where}", None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "invalid_unicode":
            field = str((err.get("ctx") or {}).get("field", ""))
            parts.append(msg)
            param = param or field.split(".")[0] or None
            continue
        if kind == "value_error" and not loc and ": " in msg:  # a check across fields
            param = param or msg.split(":")[0]
        if kind == "missing":
            msg = "field required"
        elif kind == "extra_forbidden":
            msg = "unknown field; see the OpenAI API reference for the fields of this endpoint"
        if loc and param is None:
            param = loc[0]
        if kind not in ("missing", "extra_forbidden", "value_error", "invalid_unicode") \
                and "input" in err:
            msg += f" (got {_short(err['input'])})"
        parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
    if len(errors) > 4:
        parts.append(f"and {len(errors) - 4} more")
    return "invalid request: " + "; ".join(parts), param


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Register the handlers; `on_error(status, type, path)` is called for every error
    answered."""

    def answer(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status, error.type, request.url.path)
        return error.response()

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return answer(request, exc)

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc.errors())
        return answer(request, APIError(400, message, param=param))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models, " \
                      "POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return answer(request, APIError(status, message, headers=getattr(exc, "headers", None)))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error answering %s %s", request.method, request.url.path,
                  exc_info=exc)
        return answer(request, APIError(500, f"internal server error ({type(exc).__name__}); the "
                                    "server logged the details"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
