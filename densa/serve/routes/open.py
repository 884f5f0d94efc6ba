"""Routes anyone may call, key or not: liveness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from densa.openai.errors import ErrorResponse, shutting_down
from densa.serve.metrics import CONTENT_TYPE
from densa.serve.state import engine_not_running, server_state

router = APIRouter()


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    state = server_state(request)
    if state.is_draining:
        raise shutting_down()
    if not state.engine.is_alive:
        raise engine_not_running(state.engine)
    engine = state.engine
    body = {
        "status": "ok",
        "engine_pid": engine.served.engine_pid,
        "engine_restarts": engine.num_restarts,
    }
    return JSONResponse(body)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format (docs/serving.md lists the metrics)."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)
