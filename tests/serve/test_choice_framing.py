"""n > 1 and the stream's framing, without a server (a scripted engine, the tiny model's
tokenizer): an API without a list of choices (Anthropic Messages, Responses) refuses several
choices before the engine is asked, in its own error shape; the n > 1 writer writes through the
framing it is given, as the one-choice writer does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from densa.ipc.messages import AddRequest, RequestDelta
from densa.openai.anthropic_api import formatter as anthropic
from densa.openai.errors import APIError
from densa.openai.framing import OPENAI_FRAMING, Framing, index_openai_choice
from densa.openai.responses import ChatFormatter, TokenTexts
from densa.openai.responses_api.formatter import ResponseFormatter, skeleton_of
from densa.openai.responses_api.models import ResponsesRequest
from densa.sampling_params import SamplingParams
from densa.serve import choices, pipeline
from densa.serve.generation import EngineCall
from densa.serve.tracking import _STATE_KEY, RequestRecord
from densa.text.tokenizer import Tokenizer


class ScriptedEngine:
    """Answers every request with two tokens, then ends it."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    async def generate(self, request: AddRequest) -> AsyncGenerator[RequestDelta, None]:
        self.request_ids.append(request.request_id)
        yield RequestDelta(request.request_id, [42], num_prompt_tokens=3, num_output_tokens=1)
        yield RequestDelta(request.request_id, [43], finished=True, finish_reason="length",
                           num_prompt_tokens=3, num_output_tokens=2)  # fmt: skip


@dataclass(frozen=True)
class Body:
    num_choices: int = 2
    stream: bool = True
    include_usage: bool = False


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def http_request(engine: ScriptedEngine, tokenizer: Tokenizer) -> Request:
    async def receive() -> dict[str, Any]:  # the client never leaves
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    app = SimpleNamespace(state=SimpleNamespace(densa=SimpleNamespace(
        engine=engine, tokenizer=tokenizer)))  # fmt: skip
    record = RequestRecord("req-1", "/v1/test")
    scope = {"type": "http", "app": app, "state": {_STATE_KEY: record}, "headers": []}
    return Request(scope, receive)


def call() -> EngineCall:
    return EngineCall("req-1", [1, 2, 3], SamplingParams(max_tokens=2))


async def read_events(response: Any) -> list[str]:
    return [event async for event in response.body_iterator]


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_an_api_without_choices_refuses_several_before_the_engine_runs(
    api: str, tokenizer: Tokenizer
) -> None:
    """Before, n > 1 went to a writer that knew only OpenAI's chunks: an Anthropic or Responses
    stream came out as bare `data:` chunks of several messages (or failed on their missing
    `choices`), ending in OpenAI's [DONE]."""
    engine = ScriptedEngine()
    if api == "messages":
        formatter: Any = anthropic.MessagesFormatter("req-1", "tiny", None, None)
        framing = anthropic.FRAMING
    else:
        body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi"})
        formatter = ResponseFormatter(skeleton_of("req-1", int(time.time()), body))
        framing = formatter.framing
    request = http_request(engine, tokenizer)
    with pytest.raises(APIError) as refused:
        await pipeline.respond(request, call(), lambda: formatter, Body(), framing)
    assert refused.value.status_code == 400 and refused.value.info.param == "n"
    assert engine.request_ids == []  # refused before any choice ran
    if api == "messages":  # rendered in Anthropic's error shape, as every /v1/messages error
        assert anthropic.error_body(refused.value).error.type == "invalid_request_error"


async def test_several_choices_are_written_through_the_framing_given(
    tokenizer: Tokenizer,
) -> None:
    """The n > 1 writer ends and indexes its events as the framing says (here: no terminator,
    and an indexer that keeps count), like the one-choice writer."""
    engine = ScriptedEngine()
    texts = TokenTexts(tokenizer)

    def new_formatter() -> ChatFormatter:
        return ChatFormatter("req-1", 0, "tiny", texts, None)

    indexed: list[int] = []

    def index_choice(chunk: Any, index: int) -> Any:
        indexed.append(index)
        return index_openai_choice(chunk, index)

    framing = Framing(done="", index_choice=index_choice)
    request = http_request(engine, tokenizer)
    calls = choices.choice_calls(call(), 2)
    response = await choices.respond(
        request,
        engine,
        tokenizer,
        calls,
        pipeline._record(request),
        new_formatter,
        True,
        False,
        framing,
    )  # type: ignore[arg-type]
    events = await read_events(response)
    assert engine.request_ids == ["req-1", "req-1-1"]
    assert set(indexed) == {0, 1} and len(indexed) == len(events)
    assert events and "[DONE]" not in events[-1]
    plain = await choices.respond(http_request(engine, tokenizer), engine, tokenizer, calls,
                                  pipeline._record(request), new_formatter, True, False,
                                  OPENAI_FRAMING)  # type: ignore[arg-type]  # fmt: skip
    plain_events = await read_events(plain)
    assert plain_events[-1] == "data: [DONE]\n\n"
    assert all(e.startswith("data: ") for e in plain_events)
