"""The OpenAI-compatible HTTP server: routes, request preparation, and the process lifecycle.

    build_app(async_engine, name)  -> a FastAPI app over an already started AsyncEngine
    run_server(engine_args, ...)   -> load the model, serve until SIGINT/SIGTERM, drain, exit

The app never owns the engine: whoever started the AsyncEngine shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from densa.engine.args import EngineArgs
from densa.engine.async_engine import AsyncEngine
from densa.engine.llm_engine import LLMEngine
from densa.model.tokenizer import ChatTemplateError, Tokenizer
from densa.serve import generation
from densa.serve.errors import (
    APIError,
    bad_request,
    from_validation_error,
    install_error_handlers,
    model_not_found,
    shutting_down,
)
from densa.serve.generation import EngineCall, SSEResponse, StreamFormatter
from densa.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from densa.serve.responses import ChatFormatter, CompletionFormatter, Generation, TokenTexts
from densa.utils.logging import configure_logging, get_logger

logger = get_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
SESSION_HEADER = "x-session-affinity"
RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass
class ServerState:
    """What the routes share; lives on `app.state.densa`."""

    engine: AsyncEngine
    served_model_name: str
    max_body_bytes: int
    token_texts: TokenTexts
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False  # set on SIGINT/SIGTERM: new requests get 503 while old ones finish

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.scheduler.max_model_len

    def check_can_serve(self, model: str) -> None:
        if self.is_draining:
            raise shutting_down()
        if not self.engine.is_alive:
            raise _engine_not_running()
        if model != self.served_model_name:
            raise model_not_found(model, self.served_model_name)

    def check_prompt_len(self, num_tokens: int, param: str) -> None:
        if num_tokens >= self.max_model_len:
            message = (
                f"this model's context is {self.max_model_len} tokens, but the {param} take "
                f"{num_tokens} tokens (and the answer needs at least one); shorten the {param}"
            )
            raise bad_request(message, code="context_length_exceeded", param=param)


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(title="densa", docs_url=None, redoc_url=None)
    app.state.densa = ServerState(
        engine=async_engine,
        served_model_name=served_model_name,
        max_body_bytes=max_body_bytes,
        token_texts=TokenTexts(async_engine.engine.tokenizer),
    )
    install_error_handlers(app)
    app.include_router(router)
    return app


def start_draining(app: FastAPI) -> None:
    """Refuse new requests with 503 (and fail /health) while the running ones finish."""
    app.state.densa.is_draining = True


# ---- routes -------------------------------------------------------------------------------------
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.densa


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.is_draining:
        raise shutting_down()
    if not state.engine.is_alive:
        raise _engine_not_running()
    return JSONResponse({"status": "ok"})


def _engine_not_running() -> APIError:
    message = "the engine thread has stopped; restart the server (its log says why)"
    return APIError(503, message, "engine_not_running", error_type="server_error")


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(_state(request))])


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> ModelCard:
    state = _state(request)
    if model_id != state.served_model_name:
        raise model_not_found(model_id, state.served_model_name)
    return _model_card(state)


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.served_model_name, created=state.created, max_model_len=state.max_model_len
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = _parse(ChatCompletionRequest, await read_json(request, state.max_body_bytes))
    state.check_can_serve(body.model)
    prompt_ids = await _chat_prompt(state, body)
    max_tokens = body.requested_max_tokens or state.max_model_len - len(prompt_ids)
    call = _engine_call(request, body, "chatcmpl", prompt_ids, max_tokens, body.num_logprobs)
    formatter = ChatFormatter(
        call.request_id, int(time.time()), body.model, state.token_texts, body.num_logprobs
    )
    return await _respond(request, state, call, formatter, body)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    body = _parse(CompletionRequest, await read_json(request, state.max_body_bytes))
    state.check_can_serve(body.model)
    prompt_ids = await _completion_prompt(state, body)
    call = _engine_call(
        request, body, "cmpl", prompt_ids, body.requested_max_tokens, body.num_logprobs
    )
    formatter = CompletionFormatter(
        call.request_id, int(time.time()), body.model, state.token_texts, body.num_logprobs
    )
    return await _respond(request, state, call, formatter, body)


class _Formatter(StreamFormatter, Protocol):
    def response(self, generation: Generation) -> BaseModel: ...


async def _respond(
    request: Request,
    state: ServerState,
    call: EngineCall,
    formatter: _Formatter,
    body: SamplingFields,
) -> Response:
    first, outputs = await generation.start(request, state.engine, call)
    if body.stream:
        return SSEResponse(generation.sse_events(first, outputs, formatter, body.include_usage))
    result = await generation.until_disconnected(request, generation.collect(first, outputs))
    return Response(formatter.response(result).model_dump_json(), media_type="application/json")


# ---- request preparation ------------------------------------------------------------------------
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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _too_large(max_bytes: int) -> APIError:
    message = f"the request body exceeds the server's limit of {max_bytes} bytes"
    return APIError(413, message, code="request_too_large")


def _parse(model: type[RequestT], data: Any) -> RequestT:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [m.to_template() for m in body.messages]
    try:
        # Tokenizing a long prompt takes milliseconds: keep the event loop free meanwhile.
        prompt_ids = await asyncio.to_thread(state.tokenizer.encode_chat, messages)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), code="invalid_messages", param="messages") from exc
    state.check_prompt_len(len(prompt_ids), "messages")
    return prompt_ids


async def _completion_prompt(state: ServerState, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
        prompt_ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt)
    else:
        prompt_ids = body.prompt
    if not prompt_ids:
        raise bad_request("the prompt is empty", param="prompt")
    state.check_prompt_len(len(prompt_ids), "prompt")
    return prompt_ids


def _engine_call(
    request: Request,
    body: SamplingFields,
    id_prefix: str,
    prompt_ids: list[int],
    max_tokens: int,
    num_logprobs: int | None,
) -> EngineCall:
    try:
        params = body.to_sampling_params(max_tokens, num_logprobs)
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    return EngineCall(
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        params=params,
        cache_scope=cache_scope(request, body),
        session_id=request.headers.get(SESSION_HEADER),
    )


def cache_scope(request: Request, body: SamplingFields) -> str:
    """The prefix-cache namespace: requests reuse each other's cached pages only within one scope.

    Each part narrows it: the API key (hashed, as the scope is kept in memory and may be logged)
    separates tenants, `user` separates a tenant's end users, and `cache_salt` lets a client opt
    out of sharing altogether. Parts combine rather than replace, so no salt reaches across keys.
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


# ---- the process --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 unparsed
    drain_timeout: float = 30.0  # seconds a signal waits for running requests before aborting them
    log_level: str = "info"


def run_server(
    engine_args: EngineArgs, host: str = "127.0.0.1", port: int = 8000, **server_options: Any
) -> None:
    """Load the model, serve until SIGINT/SIGTERM, then drain running requests and return."""
    options = ServerOptions(**server_options)
    configure_logging(options.log_level)
    logger.info("loading the model %s", engine_args.model or "(bundled SmolLM2-135M)")
    started = time.monotonic()
    engine = LLMEngine.from_args(engine_args)
    name = engine.config.model.served_model_name
    logger.info("model %r loaded in %.1f s", name, time.monotonic() - started)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    app = build_app(async_engine, name, max_body_bytes=options.max_body_bytes)
    asyncio.run(_serve(app, async_engine, host, port, options))
    logger.info("server stopped")


async def _serve(
    app: FastAPI, engine: AsyncEngine, host: str, port: int, options: ServerOptions
) -> None:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=options.log_level,
        timeout_graceful_shutdown=math.ceil(options.drain_timeout),
    )

    def on_signal() -> None:
        logger.info(
            "shutting down: refusing new requests, draining %d (up to %.0f s)",
            engine.num_in_flight, options.drain_timeout,
        )  # fmt: skip
        start_draining(app)

    try:
        await _DrainingServer(config, on_signal).serve()
    finally:
        await engine.shutdown(options.drain_timeout)


class _DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown (stop listening, wait for open requests), plus two changes:
    the app refuses new requests from the first signal on, and the process exits normally after
    draining instead of re-raising the signal as uvicorn does."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
