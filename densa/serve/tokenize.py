"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes, with the served model's tokenizer.

    /tokenize    {"prompt": text}        -> the ids /v1/completions would run for that text
                 {"messages": [...]}     -> the ids /v1/chat/completions would run (chat template,
                                            tools and chat_template_kwargs applied the same way)
                 -> {"count", "max_model_len", "tokens", "token_strs" (with return_token_strs)}
    /detokenize  {"tokens": [ids]}       -> {"prompt": text}

`model` is optional (vLLM's rule); given, it must be one the server serves. Nothing here reaches
the engine: these are answered by the front alone.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, model_validator

from densa.openai import prepare
from densa.openai.body import RequestBody
from densa.openai.errors import bad_request
from densa.openai.fields import INTEGRAL, TemplateKwargs, Unsupported
from densa.openai.headers import IGNORED_FIELDS_HEADER
from densa.openai.protocol import ChatCompletionRequest, ChatMessage
from densa.openai.tools.models import ToolDefinition
from densa.openai.unknown_fields import header_value
from densa.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from densa.serve.state import ServerState


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions encodes a text prompt
    return_token_strs: bool = False


class TokenizeChatRequest(RequestBody):
    """The prompt a chat completion with these fields would run. densa decides the end of the
    prompt as chat completions do (a final assistant message is continued, else answered): the
    two vLLM flags are accepted when they agree with that, and a 400 says so when not."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    chat_template_kwargs: TemplateKwargs | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: Annotated[Any, Unsupported("add_special_tokens with messages", False)] = (
        None
    )
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _ends_as_chat_completions_do(self) -> TokenizeChatRequest:
        last = self.messages[-1]
        continues = last.role == "assistant" and not last.tool_calls
        if self.continue_final_message not in (None, continues):
            raise ValueError(f"continue_final_message must be {continues} for these messages")
        if self.add_generation_prompt not in (None, not continues):
            raise ValueError(f"add_generation_prompt must be {not continues} for these messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0), INTEGRAL]]


class DetokenizeResponse(BaseModel):
    prompt: str


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)


async def tokenize(request: Request, state: ServerState) -> Response:
    data = await _read_json(request, state)
    ignored: list[str] | None = None if state.api.strict_api else []
    if isinstance(data, dict) and "messages" in data:
        chat = prepare.parse(TokenizeChatRequest, data, ignored)
        ids = await _chat_ids(state.tokenizer_for(chat.model), chat, state)
        body = _tokenized(state, ids, chat.return_token_strs)
    else:
        text = prepare.parse(TokenizeCompletionRequest, data, ignored)
        ids = await _text_ids(state.tokenizer_for(text.model), text, state.max_model_len)
        body = _tokenized(state, ids, text.return_token_strs)
    return _json(request, state, body, ignored)


async def detokenize(request: Request, state: ServerState) -> Response:
    data = await _read_json(request, state)
    ignored: list[str] | None = None if state.api.strict_api else []
    parsed = prepare.parse(DetokenizeRequest, data, ignored)
    tokenizer = state.tokenizer_for(parsed.model)
    bad = [t for t in parsed.tokens if t >= tokenizer.vocab_size]
    if bad:
        message = f"token ids out of range [0, {tokenizer.vocab_size}): {bad[:5]}"
        raise bad_request(message, code="invalid_value", param="tokens")
    text = tokenizer.decode(parsed.tokens, skip_special_tokens=False)
    return _json(request, state, DetokenizeResponse(prompt=text), ignored)


async def _read_json(request: Request, state: ServerState) -> Any:
    return await prepare.read_json(
        request, state.max_body_bytes, state.body_timeout, state.large_bodies
    )


async def _text_ids(
    tokenizer: Tokenizer, text: TokenizeCompletionRequest, max_model_len: int
) -> list[int]:
    """Text too long for any prompt is refused before it costs a tokenizer pass (a 4 MB text
    takes seconds), as /v1/completions refuses it; tokenizing runs off the event loop."""
    prepare.check_text_size(tokenizer, len(text.prompt.encode()), max_model_len, "prompt")
    return await asyncio.to_thread(tokenizer.encode, text.prompt, text.add_special_tokens)


async def _chat_ids(
    tokenizer: Tokenizer, chat: TokenizeChatRequest, state: ServerState
) -> list[int]:
    """The ids chat completions would run: the same rendering, from the same request fields."""
    body = ChatCompletionRequest.model_construct(
        model=chat.model or "",
        messages=chat.messages,
        tools=chat.tools,
        chat_template_kwargs=chat.chat_template_kwargs,
    )
    plan = prepare.tool_plan(state.tool_format, body)
    return await prepare.chat_prompt(tokenizer, body, state.max_model_len, plan, state.tool_format)


def _tokenized(state: ServerState, ids: list[int], with_strs: bool) -> TokenizeResponse:
    assert state.tokenizer is not None  # tokenizer_for checked it
    strs = state.tokenizer.convert_ids_to_tokens(ids) if with_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
    )


def _json(
    request: Request, state: ServerState, body: BaseModel, ignored: list[str] | None
) -> Response:
    headers = None
    if ignored:
        state.ignored_log.note(request.url.path, ignored)
        headers = {IGNORED_FIELDS_HEADER: header_value(ignored)}
    return JSONResponse(body.model_dump(), headers=headers)
