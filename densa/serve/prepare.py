"""From an HTTP request to an engine call: read and validate the body, tokenize, check lengths.

Everything here fails with an APIError (a 4xx) before the engine sees the request, so a bad request
changes nothing on the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from densa.model.tokenizer import ChatTemplateError, Tokenizer
from densa.serve.errors import APIError, bad_request, from_validation_error
from densa.serve.protocol import ChatCompletionRequest, CompletionRequest

RequestT = TypeVar("RequestT", bound=BaseModel)


# ---- the body -----------------------------------------------------------------------------------
async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON, refusing oversized (413), non-UTF-8 and malformed (400) bodies."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:  # a chunked body has no Content-Length to check up front
            raise _too_large(max_bytes)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"the request body is not valid UTF-8 (bad byte at offset {exc.start})"
        raise bad_request(message, code="invalid_encoding") from exc
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {exc}", "invalid_json") from exc
    except RecursionError as exc:  # [[[[...]]]] nested deeper than the parser's stack
        raise bad_request("the request body nests too deeply", "invalid_json") from exc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _too_large(max_bytes: int) -> APIError:
    message = f"the request body exceeds the server's limit of {max_bytes} bytes"
    return APIError(413, message, code="request_too_large")


def parse(model: type[RequestT], data: Any) -> RequestT:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


# ---- prompts and lengths ------------------------------------------------------------------------
async def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    messages = [m.to_template() for m in body.messages]
    try:
        # Tokenizing a long prompt takes milliseconds: keep the event loop free meanwhile.
        return await asyncio.to_thread(tokenizer.encode_chat, messages)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), code="invalid_messages", param="messages") from exc


async def completion_prompt(tokenizer: Tokenizer, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
        prompt_ids = await asyncio.to_thread(tokenizer.encode, body.prompt)
    else:
        prompt_ids = body.prompt
    if not prompt_ids:
        raise bad_request("the prompt is empty", param="prompt")
    return prompt_ids


def check_lengths(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, params: tuple[str, str]
) -> None:
    """The prompt plus the requested output must fit the context (OpenAI rejects, not truncates).

    params: the names of the prompt field and of the max-tokens field the client used.
    """
    prompt_param, max_tokens_param = params
    if num_prompt_tokens >= max_model_len:
        message = (
            f"this model's context is {max_model_len} tokens, but the {prompt_param} take "
            f"{num_prompt_tokens} tokens (and the answer needs at least one); "
            f"shorten the {prompt_param}"
        )
        raise bad_request(message, code="context_length_exceeded", param=prompt_param)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        message = (
            f"this model's context is {max_model_len} tokens, but you asked for "
            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the {prompt_param}, "
            f"{max_tokens} in {max_tokens_param}); lower {max_tokens_param} to at most "
            f"{max_model_len - num_prompt_tokens}"
        )
        raise bad_request(message, code="context_length_exceeded", param=max_tokens_param)


# ---- the prefix-cache scope ---------------------------------------------------------------------
def cache_scope(request: Request, body: ChatCompletionRequest | CompletionRequest) -> str:
    """The prefix-cache namespace: requests reuse each other's cached pages only within one scope.

    Each part narrows it: the API key (hashed, as the scope is kept in memory and may be logged)
    separates tenants, `user` separates a tenant's end users, and `cache_salt` lets a client opt
    out of sharing altogether. Parts combine rather than replace, so no salt reaches across keys.
    Because a foreign scope never hits, a tenant cannot learn from response times whether another
    tenant sent a given prompt.
    """
    parts = []
    authorization = request.headers.get("authorization")
    if authorization:
        parts.append("key:" + hashlib.sha256(authorization.encode()).hexdigest()[:32])
    if body.user:
        parts.append("user:" + body.user)
    if body.cache_salt:
        parts.append("salt:" + body.cache_salt)
    return "|".join(parts)
