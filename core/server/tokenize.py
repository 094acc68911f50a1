"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them (no `/v1` prefix).

/tokenize takes a text (`prompt`, `add_special_tokens` default true) or chat `messages`
(through the model's chat template: `add_generation_prompt` default true,
`add_special_tokens` default false, the template supplying any BOS) and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with `return_token_strs`).
/detokenize takes `tokens` and answers `{"prompt"}`. `GET /tokenizer_info` answers the special
tokens, the chat template and the context length. All run on the HTTP side with the engine's
read-only tokenizer. lm-eval's API backends probe them and then tokenize through the server
(its `remote` tokenizer backend) instead of downloading the model's tokenizer.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from plugserve.server.errors import APIError
from plugserve.server.handlers import ServerState
from plugserve.server.protocol import Body, ChatMessage


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # text: true; chat: false
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    tokenizer = state.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt (a text) or messages (a chat), not both "
                                "and not neither", param="prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = _encode(tokenizer, body.prompt, special)
        else:
            from plugserve.model.chat_template import ChatTemplateError

            messages = [m.template_dict() for m in body.messages or []]
            try:
                text = tokenizer.render_chat(messages,
                                             add_generation_prompt=body.add_generation_prompt)
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param="messages") from None
            ids = _encode(tokenizer, text, bool(body.add_special_tokens))
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] \
            if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.context_len, "tokens": ids,
                "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        special = tokenizer.special_tokens
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": special.get("bos_token"), "eos_token": special.get("eos_token"),
                "pad_token": special.get("pad_token"), "unk_token": special.get("unk_token"),
                "chat_template": tokenizer.chat_template,
                "model_max_length": state.context_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        vocab = state.loop.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens has ids outside the vocabulary (0..{vocab - 1}): "
                                f"{bad[:5]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:
        return list(tokenizer.encode(text))
    return list(tokenizer.backend.encode(text, add_special_tokens=False).ids)
