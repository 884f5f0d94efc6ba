"""OpenAI's API: models, chat completions, (legacy) completions."""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import Response

from densa.openai import prepare
from densa.openai.errors import model_not_found
from densa.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from densa.openai.responses import ChatFormatter, CompletionFormatter, EchoedPrompt
from densa.serve.openapi import GENERATION_ERRORS, ok_or_events, request_body
from densa.serve.pipeline import (
    SessionHeader,
    calls_format,
    deadline_of,
    engine_call,
    keyed_router,
    prepare_chat,
    read_body,
    reasoning_splitter,
    respond,
    token_texts,
    with_prefill,
)
from densa.serve.state import ServerState, server_state
from densa.text.tokenizer import Tokenizer

router = keyed_router()


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[_model_card(state, name) for name in state.served_model_names])


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> ModelCard:
    state = server_state(request)
    if not state.has_model(model_id):
        raise model_not_found(model_id, state.served_model_names)
    return _model_card(state, model_id)


def _model_card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.created, max_model_len=state.max_model_len)


@router.post(
    "/v1/chat/completions",
    responses={200: ok_or_events(ChatCompletionResponse), **GENERATION_ERRORS},
    openapi_extra={"requestBody": request_body(ChatCompletionRequest)},
)
async def chat_completions(request: Request, session_id: SessionHeader = None) -> Response:
    deadline = deadline_of(request)
    body = await read_body(ChatCompletionRequest, request)
    call, plan = await prepare_chat(request, body, session_id, deadline)
    state, created = server_state(request), int(time.time())

    def new_formatter() -> ChatFormatter:  # one per choice: each parses its own answer
        return ChatFormatter(
            call.request_id,
            created,
            body.model,
            token_texts(state),
            body.num_logprobs,
            tool_format=calls_format(request, plan),
            reasoning=reasoning_splitter(request, call.prompt_token_ids, body, plan),
        )

    return await respond(request, call, new_formatter, body)


@router.post(
    "/v1/completions",
    responses={200: ok_or_events(CompletionResponse), **GENERATION_ERRORS},
    openapi_extra={"requestBody": request_body(CompletionRequest)},
)
async def completions(request: Request, session_id: SessionHeader = None) -> Response:
    state, deadline = server_state(request), deadline_of(request)
    body = await read_body(CompletionRequest, request)
    tokenizer = state.check_can_serve(body.model)
    prompt_ids, stop_token_ids = await _completion_prompt(tokenizer, body, state.max_model_len)
    prepare.check_lengths(
        state.max_model_len, len(prompt_ids), body.max_tokens, ("prompt", "max_tokens")
    )
    max_tokens = min(body.requested_max_tokens, state.max_model_len - len(prompt_ids))
    plan = prepare.completion_plan(body)
    # echo with max_tokens=0 still samples one token, which the front drops (EngineCall).
    call = engine_call(request, body, prompt_ids, max(max_tokens, 1), session_id, deadline, plan)
    params = dataclasses.replace(
        call.params,
        prompt_logprobs=body.num_prompt_logprobs,
        stop_token_ids=(*call.params.stop_token_ids, *stop_token_ids),
    )
    call = dataclasses.replace(call, params=params, prompt_only=body.prompt_only)
    if params.prompt_logprobs is None:  # a prefill worker would not send the prompt's logprobs
        call = await with_prefill(request, call)
    created = int(time.time())
    echo = EchoedPrompt(_prompt_text(tokenizer, body), prompt_ids) if body.echo else None

    def new_formatter() -> CompletionFormatter:  # one per choice: each has its text offset
        return CompletionFormatter(
            call.request_id, created, body.model, token_texts(state), body.num_logprobs, echo
        )

    return await respond(request, call, new_formatter, body)


async def _completion_prompt(
    tokenizer: Tokenizer, body: CompletionRequest, max_model_len: int
) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's tokens, and the stop tokens it adds (a fill-in-the-middle prompt's)."""
    if body.suffix is None:
        return await prepare.completion_prompt(tokenizer, body, max_model_len), ()
    fim = await prepare.fim_completion_prompt(tokenizer, body, max_model_len)
    return fim.token_ids, fim.stop_token_ids


def _prompt_text(tokenizer: Tokenizer, body: CompletionRequest) -> str:
    """What echo sends back: the prompt as written, or token ids as text (special tokens too)."""
    if isinstance(body.prompt, str):
        return body.prompt
    return tokenizer.decode(body.prompt, skip_special_tokens=False)
