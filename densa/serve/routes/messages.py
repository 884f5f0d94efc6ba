"""Anthropic's Messages API on the chat pipeline (openai/anthropic_api/)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from densa.openai.anthropic_api import formatter as anthropic
from densa.openai.anthropic_api.models import (
    CountTokensRequest,
    CountTokensResponse,
    ErrorBody,
    Message,
    MessagesRequest,
)
from densa.openai.anthropic_api.to_chat import to_chat_request as anthropic_to_chat
from densa.serve.openapi import ok_or_events, request_body
from densa.serve.pipeline import (
    SessionHeader,
    calls_format,
    chat_prompt,
    deadline_of,
    keyed_router,
    note_ignored,
    prepare_chat,
    read_body,
    reasoning_splitter,
    respond,
)

router = keyed_router()
_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}


@router.post(
    "/v1/messages",
    responses={200: ok_or_events(Message), **_ANTHROPIC_ERRORS},
    openapi_extra={"requestBody": request_body(MessagesRequest)},
)
async def anthropic_messages(request: Request, session_id: SessionHeader = None) -> Response:
    """Anthropic's Messages API; the `anthropic-version` header is accepted and not needed."""
    deadline = deadline_of(request)
    body = await read_body(MessagesRequest, request)
    chat = anthropic_to_chat(body)
    if body.thinking is not None and body.thinking.budget_tokens is not None:
        note_ignored(request, ["thinking.budget_tokens"])
    call, plan = await prepare_chat(request, chat, session_id, deadline)
    formatter = anthropic.MessagesFormatter(
        call.request_id,
        body.model,
        calls_format(request, plan),
        reasoning_splitter(request, call.prompt_token_ids, chat, plan),
    )
    return await respond(request, call, lambda: formatter, chat, anthropic.FRAMING)


@router.post(
    "/v1/messages/count_tokens",
    responses={200: {"model": CountTokensResponse}, **_ANTHROPIC_ERRORS},
    openapi_extra={"requestBody": request_body(CountTokensRequest)},
)
async def anthropic_count_tokens(request: Request) -> Response:
    """The prompt's length as /v1/messages would render it (tools included)."""
    chat = anthropic_to_chat(await read_body(CountTokensRequest, request))
    prompt_ids, _ = await chat_prompt(request, chat)
    count = CountTokensResponse(input_tokens=len(prompt_ids))
    return Response(count.model_dump_json(), media_type="application/json")
