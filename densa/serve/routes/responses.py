"""OpenAI's Responses API, stateless, on the chat pipeline (openai/responses_api/)."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from densa.openai.responses_api.formatter import ResponseFormatter, skeleton_of
from densa.openai.responses_api.models import ResponseObject, ResponsesRequest
from densa.openai.responses_api.to_chat import to_chat_request as responses_to_chat
from densa.serve.openapi import GENERATION_ERRORS, ok_or_events, request_body
from densa.serve.pipeline import (
    SessionHeader,
    calls_format,
    deadline_of,
    keyed_router,
    prepare_chat,
    read_body,
    reasoning_splitter,
    respond,
)

router = keyed_router()


@router.post(
    "/v1/responses",
    responses={200: ok_or_events(ResponseObject), **GENERATION_ERRORS},
    openapi_extra={"requestBody": request_body(ResponsesRequest)},
)
async def openai_responses(request: Request, session_id: SessionHeader = None) -> Response:
    """OpenAI's Responses API, stateless: the whole conversation comes in `input`."""
    deadline = deadline_of(request)
    body = await read_body(ResponsesRequest, request)
    chat = responses_to_chat(body)
    call, plan = await prepare_chat(request, chat, session_id, deadline)
    skeleton = skeleton_of(call.request_id, int(time.time()), body)
    reasoning = reasoning_splitter(request, call.prompt_token_ids, chat, plan)
    formatter = ResponseFormatter(skeleton, calls_format(request, plan), reasoning)
    return await respond(request, call, lambda: formatter, chat, formatter.framing)
