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
    # One call (with parallel calls the model goes on to a second one, cut by max_tokens).
    settings: dict[str, Any] = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER],
                                "tool_choice": "required", "parallel_tool_calls": False,
                                "temperature": 0, "max_tokens": 60}  # fmt: skip
    return server.client().chat.completions.create(**(settings | kwargs))


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_on_the_real_model(server: RunningServer, tool_choice: Any) -> None:
    choice = _ask(server, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls", choice
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
