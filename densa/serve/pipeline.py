"""What every generation route does, whatever API it speaks: check the key, read the body,
prepare the engine call (prompt, tools, lengths, prefill worker), and respond whole or streamed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Annotated, Protocol

from fastapi import APIRouter, Depends, Header, Request, Security
from fastapi.responses import Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from densa.cache.scope import tenant_of
from densa.openai import prepare, templates
from densa.openai.errors import ErrorResponse, bad_request
from densa.openai.framing import OPENAI_FRAMING, Framing, StreamFormatter
from densa.openai.headers import SESSION_HEADER
from densa.openai.protocol import ChatCompletionRequest, CompletionRequest
from densa.openai.reasoning import ReasoningSplitter
from densa.openai.responses import Generation, TokenTexts
from densa.openai.tools.formats import ToolCallFormat
from densa.openai.tools.plan import NO_TOOLS, ToolPlan
from densa.serve import choices, generation
from densa.serve.disagg import prefill_address
from densa.serve.generation import EngineCall, SSEResponse
from densa.serve.state import ServerState, server_state
from densa.serve.tracking import RequestRecord, record_of

_bearer = HTTPBearer(auto_error=False, description="an API key, when the server sets --api-key")
_x_api_key = APIKeyHeader(
    name="x-api-key", auto_error=False, description="the same key, as Anthropic's clients send it"
)


async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    x_api_key: Annotated[str | None, Security(_x_api_key)],
) -> None:
    """Check the key (from `Authorization: Bearer`, else `x-api-key`), and remember whose it is:
    the tenant part of the prefix-cache scope is the key's identity, however the header spelled
    it (`bearer K`, `Bearer K`, `x-api-key: K`)."""
    if credentials is None and x_api_key is not None:
        credentials = HTTPAuthorizationCredentials(scheme="Bearer", credentials=x_api_key)
    server_state(request).api_keys.check(credentials)
    request.state.tenant = tenant_of(credentials.credentials) if credentials else None


def keyed_router() -> APIRouter:
    """A router whose routes need the API key (when the server has keys)."""
    return APIRouter(
        dependencies=[Depends(require_api_key)],
        responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
    )


SessionHeader = Annotated[
    str | None,
    Header(
        alias=SESSION_HEADER,
        description="ties the turns of one conversation together: their cached prefix pages "
        "are kept longer, and a router keeps them on one worker",
    ),
]


async def prepare_chat(
    request: Request,
    body: ChatCompletionRequest,
    session_id: str | None,
    deadline: float | None,
) -> tuple[EngineCall, ToolPlan]:
    """A chat request as an engine call: its tools planned, its prompt rendered, lengths checked."""
    state = server_state(request)
    prompt_ids, plan = await chat_prompt(request, body)
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.requested_max_tokens
    prepare.check_lengths(state.max_model_len, len(prompt_ids), max_tokens, ("messages", param))
    max_tokens = max_tokens or state.max_model_len - len(prompt_ids)
    call = engine_call(request, body, prompt_ids, max_tokens, session_id, deadline, plan)
    return await with_prefill(request, call), plan


async def chat_prompt(request: Request, body: ChatCompletionRequest) -> tuple[list[int], ToolPlan]:
    """The conversation's prompt tokens, with the tools its plan shows."""
    state = server_state(request)
    tokenizer = state.check_can_serve(body.model)
    note_ignored(request, templates.unread_fields(tokenizer, body))
    plan = prepare.tool_plan(state.tool_format, body)
    prompt_ids = await prepare.chat_prompt(
        tokenizer, body, state.max_model_len, plan, state.tool_format
    )
    return prompt_ids, plan


def calls_format(request: Request, plan: ToolPlan) -> ToolCallFormat | None:
    """The format the answer is read for calls in; None when the request offers no tools."""
    return server_state(request).tool_format.with_tools(plan.tools) if plan.parse_calls else None


def reasoning_splitter(
    request: Request, prompt_ids: list[int], body: ChatCompletionRequest, plan: ToolPlan
) -> ReasoningSplitter | None:
    """The split of one answer's reasoning from its content; None without --reasoning-parser."""
    state = server_state(request)
    fmt, tokenizer = state.reasoning_format, state.tokenizer
    if fmt is None:
        return None
    assert tokenizer is not None  # checked by prepare_chat (check_can_serve)
    splitter = fmt.splitter(tokenizer, prompt_ids, templates.template_variables(tokenizer, body))
    if not plan.parse_calls:
        splitter.drop_calls()
    return splitter


class _Formatter(StreamFormatter, Protocol):
    def response(self, generation: Generation) -> BaseModel: ...


class ResponseShape(Protocol):
    """What `respond` reads of a request body (SamplingFields has it; so does /infill's)."""

    @property
    def num_choices(self) -> int: ...

    @property
    def stream(self) -> bool: ...

    @property
    def include_usage(self) -> bool: ...


async def respond(
    request: Request,
    call: EngineCall,
    new_formatter: Callable[[], _Formatter],
    body: ResponseShape,
    framing: Framing = OPENAI_FRAMING,
) -> Response:
    record, state = _record(request), server_state(request)
    assert state.tokenizer is not None  # checked by check_can_serve
    if body.num_choices > 1:  # n > 1: serve/choices.py
        if not framing.has_choices:  # Anthropic Messages, Responses: one answer per request
            raise bad_request("this API answers with one message: n must be 1", param="n")
        calls = choices.choice_calls(call, body.num_choices)
        return await choices.respond(
            request, state.engine, state.tokenizer, calls, record, new_formatter, body.stream,
            body.include_usage, framing,
        )  # fmt: skip
    formatter = new_formatter()
    first, outputs = await generation.start(request, state.engine, state.tokenizer, call, record)
    if body.stream:
        events = generation.sse_events(
            call, record, first, outputs, formatter, body.include_usage, framing
        )
        return SSEResponse(events)
    result = await generation.collect(request, call, record, first, outputs)
    return Response(formatter.response(result).model_dump_json(), media_type="application/json")


async def read_body(model: type[prepare.RequestT], request: Request) -> prepare.RequestT:
    """The body as `model`; unknown fields are dropped (warned about once per name, and named
    in the response's x-densa-ignored-fields header) unless the server runs --strict-api."""
    state = server_state(request)
    ignored: list[str] | None = None if state.api.strict_api else []
    body = await prepare.read_request(
        model, request, state.max_body_bytes, state.body_timeout, state.large_bodies, ignored
    )
    note_ignored(request, ignored or [])
    return body


def note_ignored(request: Request, names: list[str]) -> None:
    """Warn about ignored request fields (once per name) and name them in the response header."""
    if not names:
        return
    server_state(request).ignored_log.note(request.url.path, names)
    record = record_of(request)
    if record is not None:
        record.ignored_fields.extend(n for n in names if n not in record.ignored_fields)


def token_texts(state: ServerState) -> TokenTexts:
    assert state.token_texts is not None  # set with the tokenizer when the engine started
    return state.token_texts


def deadline_of(request: Request) -> float | None:
    """The event-loop time by which the request must be done (the clock starts on arrival)."""
    timeout = server_state(request).request_timeout
    return None if timeout is None else asyncio.get_running_loop().time() + timeout


def _record(request: Request) -> RequestRecord:
    record = record_of(request)
    assert record is not None, "RequestTracking opens a record for every generation endpoint"
    return record


def engine_call(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    max_tokens: int,
    session_id: str | None,
    deadline: float | None,
    plan: ToolPlan = NO_TOOLS,
) -> EngineCall:
    try:
        params = body.to_sampling_params(max_tokens, body.num_logprobs, plan.constraint)
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    if plan.marker_token_ids:  # the call parser reads the markers, special tokens or not
        params = dataclasses.replace(params, kept_special_token_ids=plan.marker_token_ids)
    prepare.check_token_ids(server_state(request).served, prompt_ids, params)
    record = _record(request)
    record.session_id = session_id or body.prompt_cache_key or None
    record.safety_identifier = body.safety_identifier
    return EngineCall(
        request_id=record.request_id,
        prompt_token_ids=prompt_ids,
        params=params,
        cache_scope=prepare.cache_scope(getattr(request.state, "tenant", None), body),
        session_id=record.session_id,
        timeout=server_state(request).request_timeout,
        deadline=deadline,
    )


async def with_prefill(request: Request, call: EngineCall) -> EngineCall:
    """A decode worker: the prefill worker the request names (header x-densa-prefill)."""
    state = server_state(request)
    address = await prefill_address(
        request, state.served.role, state.prefill_peers, state.placement
    )
    return dataclasses.replace(call, prefill_address=address) if address else call
