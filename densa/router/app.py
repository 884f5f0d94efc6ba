"""The router's HTTP app: the workers' OpenAI endpoints, proxied, plus its own /health, /metrics.

build_router_app(config)  -> a FastAPI app; its lifespan opens the HTTP client to the workers,
                             polls their load, and learns the model (tokenizer, page size)
                             from the first worker that answers GET /densa/info
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from densa.ipc.messages import TokenizerFiles
from densa.openai.errors import APIError, install_error_handlers
from densa.openai.tools.formats import format_for
from densa.router.config import RouterConfig
from densa.router.incoming import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    ModelInfo,
    read_incoming,
)
from densa.router.lengths import LengthEstimator
from densa.router.membership import apply_membership, check_admin, describe, roles_from_body
from densa.router.metrics import CONTENT_TYPE, RouterMetrics
from densa.router.policy import make_policy
from densa.router.prefix import SharedTierIndex, WorkerPrefixIndex
from densa.router.proxy import WORKER_HEADER, Proxy, no_worker_available
from densa.router.ring import HashRing
from densa.router.routing import Router
from densa.router.sessions import SessionTable
from densa.router.tokens import PieceCachingTokenizer
from densa.router.workers import Worker, WorkerPool
from densa.utils.logging import get_logger

logger = get_logger(__name__)
_INFO_RETRY_S = 0.5
_MAX_MODEL_ID_LEN = 512
# Requests to workers may go out as a header write and a body write: without TCP_NODELAY the
# second could wait for the worker's delayed ACK of the first (see densa/utils/net.py).
_NO_DELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


@dataclass
class RouterState:
    config: RouterConfig
    router: Router
    metrics: RouterMetrics
    proxy: Proxy | None = None  # set by the lifespan (it owns the HTTP client)


# Blocks the router remembers as fetchable from each shared tier (LRU): ~4 GB of 1.5B pages.
SHARED_INDEX_BLOCKS = 1 << 14


def build_router(config: RouterConfig) -> tuple[Router, RouterMetrics]:
    workers = {url: Worker(url, role, WorkerPrefixIndex(1)) for url, role in config.roles().items()}
    pool = WorkerPool(workers, config.health)
    metrics = RouterMetrics(lambda: list(pool.workers.values()))
    targets = [url for url, w in workers.items() if w.role != "prefill"]
    router = Router(
        pool=pool,
        policy=make_policy(config.policy, config.weights),
        sessions=SessionTable(config.session_ttl_s),
        ring=HashRing(targets, config.ring_vnodes),
        lengths=LengthEstimator(config.default_expected_tokens),
        metrics=metrics,
        shared_tiers=SharedTierIndex(SHARED_INDEX_BLOCKS),
        assume_one_store=config.shared_kv_tier,
    )
    pool.on_ejected = router.on_ejected
    return router, metrics


def build_router_app(config: RouterConfig) -> FastAPI:
    router, metrics = build_router(config)
    state = RouterState(config, router, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=_NO_DELAY)
        async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
            state.proxy = Proxy(router, client, transport, timeout, metrics, config.max_attempts,
                                config.secret, config.debug_headers)  # fmt: skip
            await router.pool.poll_due(client)  # admit whoever is up before the first request
            tasks = [asyncio.create_task(router.pool.run(client)),
                     asyncio.create_task(_learn_model(router, client))]  # fmt: skip
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="densa router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)
    _add_routes(app)
    return app


async def _learn_model(router: Router, client: httpx.AsyncClient) -> None:
    """Fetch the model's facts from a healthy worker (retrying until one answers). Until then,
    requests are placed without prefix information."""
    while router.model is None:
        for worker in router.pool.healthy():
            try:
                response = await client.get(worker.endpoint("/densa/info"), timeout=10)
                if response.status_code == 200:
                    router.model = await asyncio.to_thread(model_info, response.json())
                    logger.info("model %r learned from %s", router.model.name, worker.url)
                    return
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                logger.warning("GET %s/densa/info failed: %r", worker.url, exc)
        await asyncio.sleep(_INFO_RETRY_S)


def model_info(body: dict[str, Any]) -> ModelInfo:
    files = body["tokenizer"]
    tokenizer = PieceCachingTokenizer(
        TokenizerFiles(
            files["tokenizer_json"], files.get("config_json"), files.get("chat_template")
        ),
        tuple(body.get("eos_token_ids", ())),
    )
    return ModelInfo(
        name=body["model"],
        max_model_len=int(body["max_model_len"]),
        page_size=int(body["page_size"]),
        tokenizer=tokenizer,
        tool_format=format_for(body.get("tool_call_format", "hermes"), tokenizer.added_tokens),
    )


def _state(request: Request) -> RouterState:
    return request.app.state.router


def _add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/chat/completions", _generate(CHAT), methods=["POST"])
    app.add_api_route("/v1/completions", _generate(COMPLETIONS), methods=["POST"])
    app.add_api_route("/v1/messages", _generate(MESSAGES), methods=["POST"])
    app.add_api_route("/v1/responses", _generate(RESPONSES), methods=["POST"])
    app.add_api_route("/v1/models", _list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _get_model, methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/densa/workers", _get_workers, methods=["GET"])
    app.add_api_route("/densa/workers", _put_workers, methods=["PUT"])


def _generate(endpoint: str) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        arrived = time.perf_counter()
        state = _state(request)
        body = await _read_body(request, state.config.max_body_bytes)
        incoming = await read_incoming(endpoint, body, request.headers, state.router.model)
        assert state.proxy is not None  # set by the lifespan before requests are served
        return await state.proxy.forward(incoming, request.headers, arrived)

    return handler


async def _read_body(request: Request, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            message = f"the request body exceeds the server's limit of {max_bytes} bytes"
            raise APIError(413, message, code="request_too_large")
    return bytes(body)


async def _list_models(request: Request) -> Response:
    return await _ask_models(request, "/v1/models")


async def _get_model(request: Request, model_id: str) -> Response:
    return await _ask_models(request, model_path(model_id))


def model_path(model_id: str) -> str:
    """The worker path for one model id: the id is one percent-encoded path segment, dots
    included, so no id names another path on the worker (`../../metrics` is the model
    `../../metrics` there, never its /metrics). The worker decodes it back to the same id."""
    if len(model_id) > _MAX_MODEL_ID_LEN:
        raise APIError(404, "no such model", code="model_not_found", param="model")
    return "/v1/models/" + urllib.parse.quote(model_id, safe="").replace(".", "%2E")


async def _ask_models(request: Request, path: str) -> Response:
    """Any healthy worker's answer (they serve the same model)."""
    state = _state(request)
    assert state.proxy is not None
    keys = ("authorization", "x-api-key")  # the caller's key, as either client sends it
    headers = {k: v for k, v in request.headers.items() if k.lower() in keys}
    for worker in state.router.pool.healthy():
        if worker.role == "prefill":
            continue
        try:
            upstream = await state.proxy.client.get(worker.endpoint(path), headers=headers,
                                                    timeout=10)  # fmt: skip
        except httpx.TransportError:
            continue
        debug = {WORKER_HEADER: worker.url} if state.config.debug_headers else None
        return Response(upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"),
                        headers=debug)  # fmt: skip
    return no_worker_available().to_response()


async def _health(request: Request) -> Response:
    """Open to any client, so it says only whether the router can serve, and what: the workers'
    addresses are the internal plane's topology (GET /densa/workers lists them, with the
    admin token)."""
    state = _state(request)
    if not state.router.targets():
        return no_worker_available().to_response()
    model = state.router.model.name if state.router.model is not None else None
    return JSONResponse({"status": "ok", "model": model})


async def _metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def _get_workers(request: Request) -> Response:
    state = _state(request)
    check_admin(request.headers.get("authorization"), state.config.admin_token, "list")
    return JSONResponse(describe(state.router))


async def _put_workers(request: Request) -> Response:
    """Replace the worker set (router/membership.py); answers what changed."""
    state = _state(request)
    check_admin(request.headers.get("authorization"), state.config.admin_token)
    body = await _read_body(request, state.config.max_body_bytes)
    try:
        parsed = json.loads(body)
    except ValueError:
        raise APIError(400, "the body is not valid JSON") from None
    roles = roles_from_body(parsed, has_secret=state.config.secret is not None)
    change = apply_membership(state.router, roles)
    if state.proxy is not None:  # poll the newcomers now: admitted within one round trip
        await state.router.pool.poll_due(state.proxy.client)
    return JSONResponse({"joined": list(change.joined), "left": list(change.left),
                         **describe(state.router)})  # fmt: skip
