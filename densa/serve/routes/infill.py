"""llama.cpp's /infill: fill-in-the-middle for editor plugins (openai/infill.py, openai/fim.py)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from densa.cache.scope import CacheScope
from densa.openai import prepare
from densa.openai.errors import bad_request
from densa.openai.infill import InfillFormatter, InfillRequest, InfillResponse
from densa.serve.generation import EngineCall
from densa.serve.openapi import GENERATION_ERRORS, ok_or_events, request_body
from densa.serve.pipeline import (
    SessionHeader,
    deadline_of,
    keyed_router,
    read_body,
    respond,
    with_prefill,
)
from densa.serve.state import server_state
from densa.serve.tracking import record_of

router = keyed_router()


@router.post(
    "/infill",
    responses={200: ok_or_events(InfillResponse), **GENERATION_ERRORS},
    openapi_extra={"requestBody": request_body(InfillRequest)},
)
async def infill(request: Request, session_id: SessionHeader = None) -> Response:
    """The middle between input_prefix and input_suffix, in llama.cpp's response shape."""
    state, deadline = server_state(request), deadline_of(request)
    body = await read_body(InfillRequest, request)
    model = body.model or state.served_model_names[0]
    tokenizer = state.check_can_serve(model)
    prompt, truncated = await prepare.infill_prompt(tokenizer, body, state.max_model_len)
    num_prompt_tokens, max_tokens = len(prompt.token_ids), body.requested_max_tokens
    prepare.check_lengths(
        state.max_model_len, num_prompt_tokens, max_tokens, ("input_prefix", "n_predict")
    )
    if max_tokens is None:  # up to the end of the context
        max_tokens = state.max_model_len - num_prompt_tokens
    try:
        # n_predict 0 warms the cache with the prompt: the one token sampled is dropped.
        params = body.to_sampling_params(max(max_tokens, 1), prompt.stop_token_ids)
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    prepare.check_token_ids(state.served, prompt.token_ids, params)
    record = record_of(request)
    assert record is not None, "RequestTracking opens a record for /infill"
    record.session_id = session_id
    tenant = getattr(request.state, "tenant", None)
    call = EngineCall(
        request_id=record.request_id,
        prompt_token_ids=prompt.token_ids,
        params=params,
        cache_scope=CacheScope(tenant=tenant, user=None, salt=None).digest(),
        session_id=session_id,
        timeout=state.request_timeout,
        deadline=deadline,
        prompt_only=max_tokens == 0,
    )
    call = await with_prefill(request, call)
    return await respond(request, call, lambda: InfillFormatter(model, truncated), body)
