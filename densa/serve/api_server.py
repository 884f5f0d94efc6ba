"""The OpenAI-compatible HTTP app: built from its state (state.py), its routes (routes/, one module
per API, on the shared pipeline.py) and its published OpenAPI schema (openapi.py).

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

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from densa.engine.client import EngineClient
from densa.openai.anthropic_api import formatter as anthropic
from densa.openai.errors import APIError, install_error_handlers
from densa.openai.prepare import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES
from densa.openai.tools.formats import DEFAULT_TOOL_FORMAT
from densa.serve.auth import ApiKeys
from densa.serve.disagg import PlacementPolicy, disagg_router
from densa.serve.metrics import ServerMetrics
from densa.serve.openapi import openapi_schema
from densa.serve.peer import peer_router
from densa.serve.routes import infill as infill_routes
from densa.serve.routes import messages as messages_routes
from densa.serve.routes import open as open_routes
from densa.serve.routes import openai as openai_routes
from densa.serve.routes import responses as responses_routes
from densa.serve.routes import tokenize as tokenize_routes
from densa.serve.state import ApiOptions, ServerState
from densa.serve.tracking import RequestTracking, note_error


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
    app.include_router(open_routes.router)
    app.include_router(disagg_router)  # /disagg/peer, for decode workers
    app.include_router(peer_router)  # /densa/info and /densa/load, for routers
    for routes in (openai_routes, messages_routes, responses_routes, tokenize_routes,
                   infill_routes):  # fmt: skip
        app.include_router(routes.router)
    app.add_middleware(RequestTracking, on_started=state.start, on_finished=state.finish)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


def start_draining(app: FastAPI) -> None:
    """Refuse new requests with 503 (and fail /health) while the running ones finish."""
    app.state.densa.is_draining = True


ANTHROPIC_PREFIX = "/v1/messages"  # /v1/messages and /v1/messages/count_tokens


def render_error(request: Request, error: APIError) -> Response:
    """Anthropic's clients get Anthropic's error shape; every other route OpenAI's."""
    if request.url.path.startswith(ANTHROPIC_PREFIX):
        return anthropic.error_response(error)
    return error.to_response()
