"""What a router needs from a worker, as small JSON documents (the OpenAI API does not carry them).

    GET /densa/info   once per worker: the served model, its page size and pool, its tokenizer files
                      and tool-call format -- so a router tokenizes and hashes prompt blocks exactly
                      as this worker's prefix cache does (densa/router/prefix.py)
    GET /densa/load   polled (every ~0.5 s): queue depth and free KV pages from the engine's latest
                      snapshot (at most one heartbeat, 0.5 s, old), and the id of its shared KV
                      tier's store, if any; 503 while the engine is down

Both are open like /health and /metrics: they say nothing about any request or tenant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

if TYPE_CHECKING:
    from densa.serve.state import ServerState

peer_router = APIRouter(include_in_schema=False)


def _state(request: Request) -> ServerState:
    return request.app.state.densa


@peer_router.get("/densa/info")
async def info(request: Request) -> Response:
    state = _state(request)
    if not state.engine.is_alive or state.tokenizer is None:
        return _unavailable()
    served = state.served
    files = state.tokenizer.files  # the chat template this front renders (--chat-template)
    body: dict[str, Any] = {
        "model": served.name,
        "max_model_len": served.max_model_len,
        "page_size": served.page_size,
        "num_kv_pages": served.num_kv_pages,
        "max_num_seqs": served.max_num_seqs,
        "eos_token_ids": list(served.eos_token_ids),
        "tool_call_format": state.tool_format.name,
        "engine_pid": served.engine_pid,
        "tokenizer": {
            "tokenizer_json": files.tokenizer_json,
            "config_json": files.config_json,
            "chat_template": files.chat_template,
        },
    }
    return JSONResponse(body)


@peer_router.get("/densa/load")
async def load(request: Request) -> Response:
    state = _state(request)
    if state.is_draining or not state.engine.is_alive:
        return _unavailable()
    stats = state.engine.stats
    body = {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_in_flight": state.engine.num_in_flight,  # the front's view, fresher than the engine's
        "num_kv_pages": stats.num_kv_pages,
        "num_free_kv_pages": stats.num_free_kv_pages,
        "page_size": stats.page_size,
        "engine_pid": state.served.engine_pid,
        "shared_kv_tier": stats.shared_kv_tier or None,  # an opaque id (SharedTier.store_id)
    }
    return JSONResponse(body)


def _unavailable() -> Response:
    body = {"error": {"message": "the engine is not running", "code": "engine_not_running"}}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
