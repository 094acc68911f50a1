"""Server settings: the HTTP side of `plugserve serve`, read from arguments and `PLUGSERVE_*`.

The engine's own settings stay in `plugserve.config.EngineConfig`; both read the same
environment prefix, so `PLUGSERVE_API_KEY`, `PLUGSERVE_PORT` and `PLUGSERVE_PAGE_SIZE` can
sit side by side.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PLUGSERVE_", extra="ignore", frozen=True)

    host: str = Field(default="127.0.0.1", description="address to bind (loopback by default)")
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = Field(
        default=None, description="when set, /v1/* needs 'Authorization: Bearer KEY'"
    )
    max_waiting: int = Field(
        default=256, ge=1, description="requests queued but not yet running; beyond: 503"
    )
    max_body_bytes: int = Field(default=2 << 20, ge=1024, description="request body limit")
    served_model_name: str | None = Field(
        default=None, description="model id clients use; default: the model path's name"
    )
    shutdown_timeout_s: float = Field(
        default=10.0, ge=0, description="on SIGINT/SIGTERM, how long running requests may finish"
    )
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After of a 503")
    max_n: int = Field(
        default=16, ge=1, description="most samples a request may ask per prompt (n, best_of)"
    )
    max_logprobs: int = Field(
        default=20, ge=0, description="most alternatives a request may ask per token (vLLM's "
        "--max-logprobs)"
    )
    stream_interval: int = Field(
        default=1, ge=1, description="generated tokens per streamed chunk (vLLM's "
        "--stream-interval); a request's own `stream_interval` may raise it. The first and the "
        "last chunk go at once"
    )
    tool_call_parser: str = Field(
        default="hermes", description="how tool calls are read from chat output (a registered "
        "tool parser)"
    )


def served_model_id(model: str | None, override: str | None = None) -> str:
    """The id of `/v1/models`: the override, else the model path's name, else the default's."""
    if override:
        return override
    if model is None:
        return DEFAULT_MODEL_ID
    return Path(model).name or str(model)
