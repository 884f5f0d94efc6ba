"""vLLM's /tokenize and /detokenize, answered by the front alone (serve/tokenize.py)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from densa.openai.errors import ErrorResponse
from densa.serve import tokenize as tokenization
from densa.serve.openapi import request_body
from densa.serve.pipeline import keyed_router
from densa.serve.state import server_state

router = keyed_router()
_TOKENIZE_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 413, 500, 503)
}


@router.post(
    "/tokenize",
    responses={200: {"model": tokenization.TokenizeResponse}, **_TOKENIZE_ERRORS},
    openapi_extra={
        "requestBody": request_body(
            tokenization.TokenizeCompletionRequest, tokenization.TokenizeChatRequest
        )
    },
)
async def tokenize(request: Request) -> Response:
    """The token ids of a text, or of a chat as /v1/chat/completions would render it (vLLM's)."""
    return await tokenization.tokenize(request, server_state(request))


@router.post(
    "/detokenize",
    responses={200: {"model": tokenization.DetokenizeResponse}, **_TOKENIZE_ERRORS},
    openapi_extra={"requestBody": request_body(tokenization.DetokenizeRequest)},
)
async def detokenize(request: Request) -> Response:
    """The text of token ids, special tokens included (vLLM's /detokenize)."""
    return await tokenization.detokenize(request, server_state(request))
