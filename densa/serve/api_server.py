"""The OpenAI-compatible HTTP app: its state, its routes and its published OpenAPI schema.

Anthropic Messages (/v1/messages) and OpenAI Responses (/v1/responses) are translations onto the
chat route's pipeline (openai/anthropic_api/, openai/responses_api/): the request becomes a chat
request, the engine outputs become that API's answer or events.

    build_app(engine_client)       -> a FastAPI app over an EngineClient (started by the app's
                                      lifespan, on the server's event loop; stopped with it)
    run_server(engine_args, ...)   -> (process.py) start the engine, serve, drain on SIGTERM, exit

The app knows the engine only through the client and what the engine's handshake said
(ServedModel: name, context, vocabulary, tokenizer): nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, Header, Request, Security
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from densa.cache.scope import tenant_of
from densa.engine.client import EngineClient
from densa.ipc.messages import ServedModel
from densa.openai import prepare, templates
from densa.openai.anthropic_api import formatter as anthropic
from densa.openai.anthropic_api.models import (
    CountTokensRequest,
    CountTokensResponse,
    ErrorBody,
    Message,
    MessagesRequest,
)
from densa.openai.anthropic_api.to_chat import to_chat_request as anthropic_to_chat
from densa.openai.errors import (
    APIError,
    ErrorResponse,
    bad_request,
    install_error_handlers,
    model_not_found,
    shutting_down,
)
from densa.openai.framing import OPENAI_FRAMING, Framing, StreamFormatter
from densa.openai.headers import SESSION_HEADER
from densa.openai.prepare import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES
from densa.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
)
from densa.openai.reasoning import ReasoningFormat, ReasoningSplitter, reasoning_format
from densa.openai.responses import ChatFormatter, CompletionFormatter, Generation, TokenTexts
from densa.openai.responses_api.formatter import ResponseFormatter, skeleton_of
from densa.openai.responses_api.models import ResponseObject, ResponsesRequest
from densa.openai.responses_api.to_chat import to_chat_request as responses_to_chat
from densa.openai.tools.formats import (
    DEFAULT_TOOL_FORMAT,
    FALLBACK_FORMAT,
    ToolCallFormat,
    resolve_format,
    tool_format,
)
from densa.openai.tools.plan import NO_TOOLS, ToolPlan
from densa.openai.unknown_fields import IgnoredFieldLog
from densa.serve import choices, generation
from densa.serve import tokenize as tokenization
from densa.serve.auth import ApiKeys
from densa.serve.disagg import PlacementPolicy, PrefillPeers, disagg_router, prefill_address
from densa.serve.generation import EngineCall, SSEResponse
from densa.serve.metrics import CONTENT_TYPE, ServerMetrics
from densa.serve.peer import peer_router
from densa.serve.tracking import RequestRecord, RequestTracking, note_error, record_of
from densa.text.tokenizer import Tokenizer
from densa.utils.heap import return_free_heap
from densa.utils.logging import get_logger

logger = get_logger(__name__)
request_log = get_logger("densa.requests")


@dataclass(frozen=True)
class ApiOptions:
    """How the API reads requests and writes answers (docs/serving.md)."""

    strict_api: bool = False  # unknown request fields are a 400 (else dropped, with a warning)
    served_model_names: tuple[str, ...] = ()  # ids clients may send as "model" (): the engine's
    accept_any_model_name: bool = False  # any "model" is served (responses echo it)
    reasoning_parser: str | None = None  # openai/reasoning.py: REASONING_FORMATS
    chat_template: str | None = None  # replaces the model's chat template (its text)


@dataclass
class ServerState:
    """What the routes share; lives on `app.state.densa`. The engine's facts (served, tokenizer,
    token_texts) are filled in when the engine has started (the app's lifespan)."""

    engine: EngineClient
    max_body_bytes: int
    metrics: ServerMetrics
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    request_timeout: float | None = None  # seconds per request, then it is aborted (504)
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT  # seconds to receive a body (then 408)
    tool_call_format: str = DEFAULT_TOOL_FORMAT  # as asked for ("auto": the chat template's)
    # The dialect served, bound to the tokenizer when the engine has started.
    tool_format: ToolCallFormat = field(default_factory=lambda: tool_format(FALLBACK_FORMAT))
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False  # set on SIGINT/SIGTERM: new requests get 503 while old ones finish
    num_open_responses: int = 0  # generation responses started and not yet counted and logged
    tokenizer: Tokenizer | None = None  # the front's own copy of the engine's tokenizer
    token_texts: TokenTexts | None = None
    prefill_peers: PrefillPeers = field(default_factory=PrefillPeers)  # decode role
    # Who may name a prefill worker (decode role): the router's signed token or the allowlist.
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)
    # Huge bodies one at a time, with a bounded share of CPU (prepare.LargeBodyGate).
    large_bodies: prepare.LargeBodyGate = field(default_factory=prepare.LargeBodyGate)
    api: ApiOptions = field(default_factory=ApiOptions)
    ignored_log: IgnoredFieldLog = field(default_factory=IgnoredFieldLog)

    def on_engine_started(self, served: ServedModel) -> None:
        files = served.tokenizer
        if self.api.chat_template is not None:
            files = dataclasses.replace(files, chat_template=self.api.chat_template)
        markers = self.reasoning_format.markers if self.reasoning_format else ()
        self.tokenizer = Tokenizer(files, served.eos_token_ids, shown_special_tokens=markers)
        self.token_texts = TokenTexts(self.tokenizer)
        self.tool_format = resolve_format(self.tool_call_format, self.tokenizer)
        logger.info("tool calls: %s dialect (--tool-call-format %s)", self.tool_format.name,
                    self.tool_call_format)  # fmt: skip
        # Parsing a large tokenizer.json peaks ~90 MB above what the tokenizer keeps (150k
        # tokens): give the heap's free pages back rather than hold them for the server's life.
        return_free_heap()

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        parser = self.api.reasoning_parser
        return reasoning_format(parser) if parser else None

    @property
    def served(self) -> ServedModel:
        return self.engine.served

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The ids clients may send as "model" (--served-model-name a b), the first the main one."""
        return self.api.served_model_names or (self.served.name,)

    def has_model(self, model: str) -> bool:
        return self.api.accept_any_model_name or model in self.served_model_names

    def tokenizer_for(self, model: str | None) -> Tokenizer:
        """The tokenizer, for requests that need no engine (/tokenize); `model` optional."""
        if self.tokenizer is None:
            raise _engine_not_running(self.engine)
        if model is not None and not self.has_model(model):
            raise model_not_found(model, self.served_model_names)
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.served.max_model_len

    def check_can_serve(self, model: str) -> Tokenizer:
        """Raise the 503 / 404 this request gets; else the tokenizer to prepare it with."""
        if self.is_draining:
            raise shutting_down()
        if not self.engine.is_alive or self.tokenizer is None:
            raise _engine_not_running(self.engine)
        if not self.has_model(model):
            raise model_not_found(model, self.served_model_names)
        return self.tokenizer

    def start(self, record: RequestRecord) -> None:
        self.num_open_responses += 1

    def finish(self, record: RequestRecord) -> None:
        """Count and log a request once its response is over (RequestTracking calls this)."""
        self.num_open_responses -= 1
        self.metrics.observe(record)
        request_log.info(record.log_line())


def build_app(
    engine: EngineClient,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout: float | None = None,
    api_keys: ApiKeys | None = None,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
    drain_timeout: float = 30.0,
    tool_call_format: str = DEFAULT_TOOL_FORMAT,
    placement: PlacementPolicy | None = None,
    api: ApiOptions | None = None,
) -> FastAPI:
    """The app; its lifespan starts the engine (and waits for its handshake) before the server
    accepts requests, and shuts it down (draining first) when the server stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served = await engine.start() if engine.state == "new" else engine.served
        state.on_engine_started(served)
        try:
            yield
        finally:
            await engine.shutdown(drain_timeout)
            await state.prefill_peers.close()

    app = FastAPI(title="densa", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan)
    state = ServerState(
        engine=engine,
        max_body_bytes=max_body_bytes,
        metrics=ServerMetrics(lambda: engine.stats),
        api_keys=api_keys or ApiKeys(),
        request_timeout=request_timeout,
        body_timeout=body_timeout,
        tool_call_format=tool_call_format,
        placement=placement or PlacementPolicy(),
        api=api or ApiOptions(),
    )
    app.state.densa = state
    install_error_handlers(app, render_error, note_error)
    app.include_router(open_router)
    app.include_router(disagg_router)  # /disagg/peer, for decode workers
    app.include_router(peer_router)  # /densa/info and /densa/load, for routers
    app.include_router(router)
    app.add_middleware(RequestTracking, on_started=state.start, on_finished=state.finish)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


def start_draining(app: FastAPI) -> None:
    """Refuse new requests with 503 (and fail /health) while the running ones finish."""
    app.state.densa.is_draining = True


def _state(request: Request) -> ServerState:
    return request.app.state.densa


ANTHROPIC_PREFIX = "/v1/messages"  # /v1/messages and /v1/messages/count_tokens


def render_error(request: Request, error: APIError) -> Response:
    """Anthropic's clients get Anthropic's error shape; every other route OpenAI's."""
    if request.url.path.startswith(ANTHROPIC_PREFIX):
        return anthropic.error_response(error)
    return error.to_response()


def _engine_not_running(engine: EngineClient) -> APIError:
    if engine.has_failed:
        message = f"the engine failed and was not restarted ({engine.failure}); see the log"
    else:
        message = f"the engine is not running ({engine.state}); retry shortly"
    return APIError(
        503, message, "engine_not_running", error_type="server_error", headers={"Retry-After": "1"}
    )


# ---- routes anyone may call ---------------------------------------------------------------------
open_router = APIRouter()


@open_router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    state = _state(request)
    if state.is_draining:
        raise shutting_down()
    if not state.engine.is_alive:
        raise _engine_not_running(state.engine)
    engine = state.engine
    body = {
        "status": "ok",
        "engine_pid": engine.served.engine_pid,
        "engine_restarts": engine.num_restarts,
    }
    return JSONResponse(body)


@open_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format (docs/serving.md lists the metrics)."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


# ---- the OpenAI API (API key required when the server has keys) ---------------------------------
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
    _state(request).api_keys.check(credentials)
    request.state.tenant = tenant_of(credentials.credentials) if credentials else None


router = APIRouter(
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
# Statuses every generation endpoint may answer with, besides 200.
_GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 413, 429, 500, 503, 504)
}
# Request bodies are read by hand (size limit, UTF-8 and JSON errors, strict types), so FastAPI does
# not see their models: the schema gets them from here, exactly the models the routes validate with.
_REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    CountTokensRequest,
    ResponsesRequest,
    *tokenization.REQUEST_MODELS,
)
_REF = "#/components/schemas/{model}"


def _request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """One of `models` (by reference to the published component)."""
    refs = [{"$ref": _REF.format(model=model.__name__)} for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ok(model: type[BaseModel]) -> dict[str, Any]:
    """A 200 that is JSON (`model`) or, with "stream": true, server-sent events. Before OpenAPI
    3.2 (no `itemSchema`), a text/event-stream `schema` describes each event: its `data` is one
    JSON chunk (or `[DONE]`)."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    events = {"schema": event}
    return {"model": model, "content": {"text/event-stream": events}}


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    return ModelList(data=[_model_card(state, name) for name in state.served_model_names])


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> ModelCard:
    state = _state(request)
    if not state.has_model(model_id):
        raise model_not_found(model_id, state.served_model_names)
    return _model_card(state, model_id)


def _model_card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.created, max_model_len=state.max_model_len)


@router.post(
    "/v1/chat/completions",
    responses={200: _ok(ChatCompletionResponse), **_GENERATION_ERRORS},
    openapi_extra={"requestBody": _request_body(ChatCompletionRequest)},
)
async def chat_completions(request: Request, session_id: SessionHeader = None) -> Response:
    deadline = _deadline(request)
    body = await _read(ChatCompletionRequest, request)
    call, plan = await _prepare_chat(request, body, session_id, deadline)
    state, created = _state(request), int(time.time())

    def new_formatter() -> ChatFormatter:  # one per choice: each parses its own answer
        return ChatFormatter(
            call.request_id,
            created,
            body.model,
            _token_texts(state),
            body.num_logprobs,
            tool_format=_calls_format(request, plan),
            reasoning=_reasoning_splitter(request, call.prompt_token_ids, body),
        )

    return await _respond(request, call, new_formatter, body)


async def _prepare_chat(
    request: Request,
    body: ChatCompletionRequest,
    session_id: str | None,
    deadline: float | None,
) -> tuple[EngineCall, ToolPlan]:
    """A chat request as an engine call: its tools planned, its prompt rendered, lengths checked."""
    state = _state(request)
    prompt_ids, plan = await _chat_prompt(request, body)
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.requested_max_tokens
    prepare.check_lengths(state.max_model_len, len(prompt_ids), max_tokens, ("messages", param))
    max_tokens = max_tokens or state.max_model_len - len(prompt_ids)
    call = _engine_call(request, body, prompt_ids, max_tokens, session_id, deadline, plan)
    return await _with_prefill(request, call), plan


async def _chat_prompt(request: Request, body: ChatCompletionRequest) -> tuple[list[int], ToolPlan]:
    """The conversation's prompt tokens, with the tools its plan shows."""
    state = _state(request)
    tokenizer = state.check_can_serve(body.model)
    _note_ignored(request, templates.unread_fields(tokenizer, body))
    plan = prepare.tool_plan(state.tool_format, body)
    prompt_ids = await prepare.chat_prompt(
        tokenizer, body, state.max_model_len, plan, state.tool_format
    )
    return prompt_ids, plan


def _calls_format(request: Request, plan: ToolPlan) -> ToolCallFormat | None:
    """The format the answer is read for calls in; None when the request offers no tools."""
    return _state(request).tool_format.with_tools(plan.tools) if plan.parse_calls else None


# ---- Anthropic Messages and OpenAI Responses, on the chat pipeline ------------------------------
_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}


@router.post(
    "/v1/messages",
    responses={200: _ok(Message), **_ANTHROPIC_ERRORS},
    openapi_extra={"requestBody": _request_body(MessagesRequest)},
)
async def anthropic_messages(request: Request, session_id: SessionHeader = None) -> Response:
    """Anthropic's Messages API; the `anthropic-version` header is accepted and not needed."""
    deadline = _deadline(request)
    body = await _read(MessagesRequest, request)
    chat = anthropic_to_chat(body)
    if body.thinking is not None and body.thinking.budget_tokens is not None:
        _note_ignored(request, ["thinking.budget_tokens"])
    call, plan = await _prepare_chat(request, chat, session_id, deadline)
    formatter = anthropic.MessagesFormatter(
        call.request_id,
        body.model,
        _calls_format(request, plan),
        _reasoning_splitter(request, call.prompt_token_ids, chat),
    )
    return await _respond(request, call, lambda: formatter, chat, anthropic.FRAMING)


@router.post(
    "/v1/messages/count_tokens",
    responses={200: {"model": CountTokensResponse}, **_ANTHROPIC_ERRORS},
    openapi_extra={"requestBody": _request_body(CountTokensRequest)},
)
async def anthropic_count_tokens(request: Request) -> Response:
    """The prompt's length as /v1/messages would render it (tools included)."""
    chat = anthropic_to_chat(await _read(CountTokensRequest, request))
    prompt_ids, _ = await _chat_prompt(request, chat)
    count = CountTokensResponse(input_tokens=len(prompt_ids))
    return Response(count.model_dump_json(), media_type="application/json")


@router.post(
    "/v1/responses",
    responses={200: _ok(ResponseObject), **_GENERATION_ERRORS},
    openapi_extra={"requestBody": _request_body(ResponsesRequest)},
)
async def openai_responses(request: Request, session_id: SessionHeader = None) -> Response:
    """OpenAI's Responses API, stateless: the whole conversation comes in `input`."""
    deadline = _deadline(request)
    body = await _read(ResponsesRequest, request)
    chat = responses_to_chat(body)
    call, plan = await _prepare_chat(request, chat, session_id, deadline)
    skeleton = skeleton_of(call.request_id, int(time.time()), body)
    reasoning = _reasoning_splitter(request, call.prompt_token_ids, chat)
    formatter = ResponseFormatter(skeleton, _calls_format(request, plan), reasoning)
    return await _respond(request, call, lambda: formatter, chat, formatter.framing)


def _reasoning_splitter(
    request: Request, prompt_ids: list[int], body: ChatCompletionRequest
) -> ReasoningSplitter | None:
    """The split of one answer's reasoning from its content; None without --reasoning-parser."""
    state = _state(request)
    fmt, tokenizer = state.reasoning_format, state.tokenizer
    if fmt is None:
        return None
    assert tokenizer is not None  # checked by _prepare_chat (check_can_serve)
    return fmt.splitter(tokenizer, prompt_ids, templates.template_variables(tokenizer, body))


@router.post(
    "/v1/completions",
    responses={200: _ok(CompletionResponse), **_GENERATION_ERRORS},
    openapi_extra={"requestBody": _request_body(CompletionRequest)},
)
async def completions(request: Request, session_id: SessionHeader = None) -> Response:
    state, deadline = _state(request), _deadline(request)
    body = await _read(CompletionRequest, request)
    tokenizer = state.check_can_serve(body.model)
    prompt_ids = await prepare.completion_prompt(tokenizer, body, state.max_model_len)
    prepare.check_lengths(
        state.max_model_len, len(prompt_ids), body.max_tokens, ("prompt", "max_tokens")
    )
    max_tokens = min(body.requested_max_tokens, state.max_model_len - len(prompt_ids))
    plan = prepare.completion_plan(body)
    call = _engine_call(request, body, prompt_ids, max_tokens, session_id, deadline, plan)
    call = await _with_prefill(request, call)
    created = int(time.time())

    def new_formatter() -> CompletionFormatter:  # one per choice: each has its text offset
        return CompletionFormatter(
            call.request_id, created, body.model, _token_texts(state), body.num_logprobs
        )

    return await _respond(request, call, new_formatter, body)


_TOKENIZE_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 413, 500, 503)
}


@router.post(
    "/tokenize",
    responses={200: {"model": tokenization.TokenizeResponse}, **_TOKENIZE_ERRORS},
    openapi_extra={
        "requestBody": _request_body(
            tokenization.TokenizeCompletionRequest, tokenization.TokenizeChatRequest
        )
    },
)
async def tokenize(request: Request) -> Response:
    """The token ids of a text, or of a chat as /v1/chat/completions would render it (vLLM's)."""
    return await tokenization.tokenize(request, _state(request))


@router.post(
    "/detokenize",
    responses={200: {"model": tokenization.DetokenizeResponse}, **_TOKENIZE_ERRORS},
    openapi_extra={"requestBody": _request_body(tokenization.DetokenizeRequest)},
)
async def detokenize(request: Request) -> Response:
    """The text of token ids, special tokens included (vLLM's /detokenize)."""
    return await tokenization.detokenize(request, _state(request))


class _Formatter(StreamFormatter, Protocol):
    def response(self, generation: Generation) -> BaseModel: ...


async def _respond(
    request: Request,
    call: EngineCall,
    new_formatter: Callable[[], _Formatter],
    body: SamplingFields,
    framing: Framing = OPENAI_FRAMING,
) -> Response:
    record, state = _record(request), _state(request)
    assert state.tokenizer is not None  # checked by check_can_serve
    if body.num_choices > 1:  # n > 1: serve/choices.py
        calls = choices.choice_calls(call, body.num_choices)
        return await choices.respond(
            request, state.engine, state.tokenizer, calls, record, new_formatter, body.stream,
            body.include_usage,
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


async def _read(model: type[prepare.RequestT], request: Request) -> prepare.RequestT:
    """The body as `model`; unknown fields are dropped (warned about once per name, and named
    in the response's x-densa-ignored-fields header) unless the server runs --strict-api."""
    state = _state(request)
    ignored: list[str] | None = None if state.api.strict_api else []
    body = await prepare.read_request(
        model, request, state.max_body_bytes, state.body_timeout, state.large_bodies, ignored
    )
    _note_ignored(request, ignored or [])
    return body


def _note_ignored(request: Request, names: list[str]) -> None:
    """Warn about ignored request fields (once per name) and name them in the response header."""
    if not names:
        return
    _state(request).ignored_log.note(request.url.path, names)
    record = record_of(request)
    if record is not None:
        record.ignored_fields.extend(n for n in names if n not in record.ignored_fields)


def _token_texts(state: ServerState) -> TokenTexts:
    assert state.token_texts is not None  # set with the tokenizer when the engine started
    return state.token_texts


def _deadline(request: Request) -> float | None:
    """The event-loop time by which the request must be done (the clock starts on arrival)."""
    timeout = _state(request).request_timeout
    return None if timeout is None else asyncio.get_running_loop().time() + timeout


def _record(request: Request) -> RequestRecord:
    record = record_of(request)
    assert record is not None, "RequestTracking opens a record for every generation endpoint"
    return record


def _engine_call(
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
    prepare.check_token_ids(_state(request).served, prompt_ids, params)
    record = _record(request)
    record.session_id = session_id or body.prompt_cache_key or None
    record.safety_identifier = body.safety_identifier
    return EngineCall(
        request_id=record.request_id,
        prompt_token_ids=prompt_ids,
        params=params,
        cache_scope=prepare.cache_scope(getattr(request.state, "tenant", None), body),
        session_id=record.session_id,
        timeout=_state(request).request_timeout,
        deadline=deadline,
    )


async def _with_prefill(request: Request, call: EngineCall) -> EngineCall:
    """A decode worker: the prefill worker the request names (header x-densa-prefill)."""
    state = _state(request)
    address = await prefill_address(
        request, state.served.role, state.prefill_peers, state.placement
    )
    return dataclasses.replace(call, prefill_address=address) if address else call


# ---- the published schema -----------------------------------------------------------------------
def openapi_schema(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description="OpenAI-compatible API served by densa (docs/serving.md).",
            routes=app.routes,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _REQUEST_MODELS:
            model_schema = model.model_json_schema(ref_template=_REF)
            defs = model_schema.pop("$defs", {})
            required = "model" in model_schema.get("required", [])
            _publish_limits(model_schema["properties"], app.state.densa, required)
            if not app.state.densa.api.strict_api:  # unknown fields are accepted (and dropped)
                for part in (model_schema, *defs.values()):
                    if part.get("additionalProperties") is False:
                        del part["additionalProperties"]
            components.update(defs)
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def _publish_limits(properties: dict[str, Any], state: ServerState, model_required: bool) -> None:
    """Limits that depend on the served model: its name, its vocabulary and its context."""
    if not state.api.accept_any_model_name:
        names: list[str | None] = list(state.served_model_names)
        properties["model"]["enum"] = names if model_required else [*names, None]
    max_token_id = state.served.vocab_size - 1
    for name in ("prompt", "stop_token_ids", "tokens"):
        _cap_integers(properties.get(name, {}), max_token_id)
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if name in properties:
            _cap_integers(properties[name], state.max_model_len - 1)


def _cap_integers(schema: Any, maximum: int) -> None:
    """Set `maximum` on every integer schema nested in `schema`."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for value in schema.values():
            _cap_integers(value, maximum)
    elif isinstance(schema, list):
        for item in schema:
            _cap_integers(item, maximum)
