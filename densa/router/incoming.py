"""What the router reads from a request before placing it: the prompt's tokens and cache scope
(for prefix overlap), the session, max_tokens and whether it streams.

The prompt is tokenized under its cache scope (`PieceCachingTokenizer.scoped`): text another
tenant sent before is no faster to read, so the router's timing tells nothing about it.

The prompt is rendered and tokenized by the workers' own code (densa/openai/prepare.py, with the
tokenizer and tool-call format the workers reported), and the scope is the workers' own digest:
the tenant is the identity of the key (Bearer, else x-api-key, as the workers read it), and
`user` / `cache_salt` narrow it. Anthropic Messages and OpenAI Responses bodies are read as the
chat requests the workers translate them to. So a block hash here is the one the chosen worker
will look up.

The router forwards the body's bytes untouched. A body it cannot read (bad JSON, invalid fields,
a template error) is still forwarded -- the worker answers with its own exact error -- only
without prefix information.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers

from densa.cache.scope import tenant_of
from densa.openai import prepare
from densa.openai.anthropic_api.models import MessagesRequest
from densa.openai.anthropic_api.to_chat import to_chat_request as anthropic_to_chat
from densa.openai.errors import APIError
from densa.openai.headers import SESSION_HEADER
from densa.openai.protocol import ChatCompletionRequest, CompletionRequest
from densa.openai.responses_api.models import ResponsesRequest
from densa.openai.responses_api.to_chat import to_chat_request as responses_to_chat
from densa.openai.tools.formats import ToolCallFormat
from densa.router.tokens import PieceCachingTokenizer

# Bodies up to this size are tokenized on the event loop: with the piece cache that takes well
# under a millisecond, less than handing the work to a thread on a busy machine; larger ones
# (a first sight of a long document) go to a thread so they cannot stall other requests.
INLINE_BODY_BYTES = 64 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"  # Anthropic's; read as the chat request the workers translate it to
RESPONSES = "/v1/responses"  # OpenAI's; the same


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the workers described it (GET /densa/info)."""

    name: str
    max_model_len: int
    page_size: int
    tokenizer: PieceCachingTokenizer
    tool_format: ToolCallFormat


@dataclass(frozen=True)
class Incoming:
    endpoint: str
    body: bytes
    session_id: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    prompt_ids: list[int] | None = None  # None: not readable here (the worker will say why)
    scope: str = ""

    @property
    def route(self) -> str:
        """The key output lengths are learned under."""
        return self.endpoint


def tenant_from(headers: Headers) -> str | None:
    """The key's identity, as the workers take it: `Authorization: Bearer`, else `x-api-key`."""
    scheme, credentials = get_authorization_scheme_param(headers.get("authorization"))
    if scheme.lower() == "bearer" and credentials:
        return tenant_of(credentials)
    key = headers.get("x-api-key")
    return tenant_of(key) if key else None


async def read_incoming(
    endpoint: str, body: bytes, headers: Headers, model: ModelInfo | None
) -> Incoming:
    session = headers.get(SESSION_HEADER) or None
    data = _json_object(body)
    if data is None:
        return Incoming(endpoint, body, session)
    stream = data.get("stream") is True
    try:
        parsed = _parse(endpoint, data)
    except APIError:
        return Incoming(endpoint, body, session, stream)
    max_tokens = parsed.requested_max_tokens
    session = session or parsed.prompt_cache_key or None
    scope = prepare.cache_scope(tenant_from(headers), parsed)
    offload = len(body) > INLINE_BODY_BYTES
    prompt_ids = await _prompt_ids(parsed, model, scope, offload) if model is not None else None
    return Incoming(endpoint, body, session, stream, max_tokens, prompt_ids, scope)


def _parse(endpoint: str, data: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """The body as the workers read it; Messages and Responses as the chat request they become.
    Unknown fields are the worker's to refuse (--strict-api) or ignore: read past them."""
    if endpoint == COMPLETIONS:
        return prepare.parse(CompletionRequest, data, ignored=[])
    if endpoint == MESSAGES:
        return anthropic_to_chat(prepare.parse(MessagesRequest, data, ignored=[]))
    if endpoint == RESPONSES:
        return responses_to_chat(prepare.parse(ResponsesRequest, data, ignored=[]))
    return prepare.parse(ChatCompletionRequest, data, ignored=[])


async def _prompt_ids(
    parsed: ChatCompletionRequest | CompletionRequest, model: ModelInfo, scope: str, offload: bool
) -> list[int] | None:
    tokenizer, max_len = model.tokenizer.scoped(scope), model.max_model_len
    try:
        if isinstance(parsed, ChatCompletionRequest):
            plan = prepare.tool_plan(model.tool_format, parsed)
            return await prepare.chat_prompt(
                tokenizer, parsed, max_len, plan, model.tool_format, offload=offload
            )
        return await prepare.completion_prompt(tokenizer, parsed, max_len, offload=offload)
    except APIError:
        return None


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
