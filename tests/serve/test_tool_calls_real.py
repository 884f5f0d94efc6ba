"""Forced tool calls on the real Qwen2.5-Coder-0.5B, whose `<tool_call>` and `</tool_call>` are
single added tokens of its vocabulary.

Before the fix every `tool_choice: "required"` request failed with 500 `grammar_error: token
[151657] doesn't satisfy the grammar; forced bytes: got '<'`: the call grammar forced the text
`<tool_call>` byte by byte and refused the one token the model writes for it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from densa.model.loader import resolve_model_dir
from densa.openai.tools.formats import AUTO, HERMES, resolve_format
from densa.text.tokenizer import Tokenizer
from densa.worker.grammar import GrammarCompiler

from .support import MODEL_NAME, RunningServer, engine_client, running_server
from .test_tools import WEATHER

MODEL = "qwen2.5-coder-0.5b"
TOOL_CALL, END_TOOL_CALL = 151657, 151658  # Qwen2.5's marker tokens
VOCAB_SIZE = 151936  # the model's embedding rows (the tokenizer has fewer entries)
ASK = [{"role": "user", "content": "What is the weather in Paris? Use celsius."}]


@pytest.fixture(scope="module")
def qwen_dir(real_model: Callable[[str], Path]) -> Path:
    return resolve_model_dir(str(real_model(MODEL)))


def test_call_grammars_match_the_marker_tokens(qwen_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(qwen_dir)
    assert resolve_format(AUTO, tokenizer).name == "hermes"  # from Qwen2.5's own template
    fmt = HERMES.with_vocabulary(tokenizer.added_tokens)
    assert fmt.tokens == {"<tool_call>": TOOL_CALL, "</tool_call>": END_TOOL_CALL}
    text = fmt.render_calls(
        [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]
    )
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert token_ids[0] == TOOL_CALL and token_ids[-1] == END_TOOL_CALL

    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE)
    matcher = compiler.compile_now(fmt.call_grammar([WEATHER], parallel=True)).new_matcher()
    assert matcher.consume_tokens(token_ids), matcher.get_error()
    assert matcher.is_accepting()
    # Unbound, the grammar spells the marker as text, and refuses the token itself (the bug).
    unbound = compiler.compile_now(HERMES.call_grammar([WEATHER], parallel=True)).new_matcher()
    assert not unbound.consume_tokens(token_ids[:1])
    assert "doesn't satisfy the grammar" in unbound.get_error()
    compiler.shutdown()


@pytest.fixture(scope="module")
def server(qwen_dir: Path) -> Iterator[RunningServer]:
    with running_server(engine_client(qwen_dir, max_model_len=1024)) as running:
        yield running


def _ask(server: RunningServer, **kwargs: Any) -> Any:
    # parallel_tool_calls is left at its default (true), as the SDKs and agents leave it.
    settings: dict[str, Any] = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER],
                                "tool_choice": "required", "temperature": 0,
                                "max_tokens": 60}  # fmt: skip
    return server.client().chat.completions.create(**(settings | kwargs))


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [("required", None), ("required", False),
     ({"type": "function", "function": {"name": "get_weather"}}, None)],
)  # fmt: skip
def test_a_forced_call_on_the_real_model(
    server: RunningServer, tool_choice: Any, parallel: bool | None
) -> None:
    """The call, then the end of the turn: before the fix "required" with parallel calls wrote
    calls until max_tokens (the grammar allowed the end only right after `</tool_call>`, where
    Qwen writes a newline first, and <|endoftext|> did not end the turn)."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    choice = _ask(server, tool_choice=tool_choice, **extra).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert arguments["city"] == "Paris"


def test_a_streamed_forced_call_on_the_real_model(server: RunningServer) -> None:
    whole = _ask(server).choices[0]
    name, arguments, finish = None, "", None
    for chunk in _ask(server, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            name = delta.function.name or name
            arguments += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert name == whole.message.tool_calls[0].function.name == "get_weather"
    assert arguments == whole.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_returns_no_markup(
    server: RunningServer, stream: bool
) -> None:
    """max_tokens ends the answer inside the call: finish_reason "length", and no call markup
    as content (before: `content` held the cut `<tool_call>\\n{"name": "`)."""
    if not stream:
        choice = _ask(server, max_tokens=4).choices[0]
        assert choice.finish_reason == "length"
        assert not choice.message.content
        assert not choice.message.tool_calls  # the call's name was never written
        return
    content, finish = "", None
    for chunk in _ask(server, max_tokens=4, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and content == ""


def test_a_required_call_through_the_responses_api(server: RunningServer) -> None:
    """/v1/responses, tool_choice "required", parallel calls allowed: one function_call item,
    the response completed (not cut at max_output_tokens), no message item with markup."""
    flat = {"type": "function", **WEATHER["function"]}
    for stream in (False, True):
        kwargs: dict[str, Any] = {"model": MODEL_NAME, "input": ASK, "tools": [flat],
                                  "tool_choice": "required", "temperature": 0,
                                  "max_output_tokens": 60}  # fmt: skip
        if stream:
            with server.client().responses.stream(**kwargs) as events:
                list(events)
                response = events.get_final_response()
        else:
            response = server.client().responses.create(**kwargs)
        assert response.status == "completed", response
        [item] = response.output
        assert item.type == "function_call" and item.name == "get_weather"
        jsonschema.validate(json.loads(item.arguments), WEATHER["function"]["parameters"])


def test_a_required_call_through_the_messages_api(server: RunningServer) -> None:
    """/v1/messages with tool_choice {"type": "any"} through the Anthropic SDK: one tool_use
    block and stop_reason "tool_use", streamed the same."""
    import anthropic

    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
    client = anthropic.Anthropic(base_url=server.base_url, api_key="test-key", max_retries=0)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": ASK, "tools": [tool],
                              "tool_choice": {"type": "any"}, "max_tokens": 60,
                              "extra_body": {"temperature": 0}}  # fmt: skip
    message = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    for answer in (message, streamed):
        assert answer.stop_reason == "tool_use", answer
        [block] = answer.content
        assert block.type == "tool_use" and block.name == "get_weather"
        jsonschema.validate(block.input, tool["input_schema"])
    assert streamed.content[0].input == message.content[0].input


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_cannot_proceed_says_why_and_is_logged(
    server: RunningServer, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The format unbound from the vocabulary is the grammar of the bug: the request ends with
    a 500 grammar_error that names the refused token, and a WARNING with its request id."""
    state = server.app.state.densa
    bound, state.tool_format = state.tool_format, HERMES
    densa_log = logging.getLogger("densa")  # (it may not propagate once the CLI configured it)
    densa_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="densa"):
            if stream:
                with pytest.raises(openai.APIError) as info:
                    list(_ask(server, stream=True))
                error = info.value.body
            else:
                with pytest.raises(openai.InternalServerError) as info:
                    _ask(server)
                error = info.value.body
                request_id = info.value.response.headers["x-request-id"]
                assert f"request {request_id} ended with an error (grammar_error)" in caplog.text
    finally:
        state.tool_format = bound
        densa_log.removeHandler(caplog.handler)
    assert isinstance(error, dict) and error["code"] == "grammar_error", error
    assert "refused token 151657, which its own mask allowed" in error["message"]
    assert "ended with an error (grammar_error)" in caplog.text
