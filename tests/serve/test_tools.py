"""Tools and structured output through the official `openai` client: JSON-schema answers always
parse and validate, constrained tool calls always validate, a tool round trip, streamed
tool-call deltas that reassemble to the non-streamed answer, and 400s for what cannot be
enforced."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from densa.openai.tools.formats import HERMES, MAX_PARALLEL_CALLS
from densa.openai.tools.render import render_messages
from densa_bench.structured.schemas import SCHEMA_CASES

from .support import MODEL_NAME, RunningServer, engine_client, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """Room for tool definitions in the prompt and eight calls in the answer."""
    with running_server(engine_client(tiny_model_dir, max_model_len=1024)) as running:
        yield running


def chat(server: RunningServer, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 400}
    return server.client().chat.completions.create(**(settings | kwargs))


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


def test_json_schema_answers_always_parse_and_validate(server: RunningServer) -> None:
    """22 schemas (nested objects, enums, arrays, numbers, required fields), 8 at a time."""

    def ask(case: Any) -> tuple[Any, Any]:
        messages = [{"role": "user", "content": case.prompt}]
        return case, chat(
            server, messages=messages, response_format=json_schema_format(case.schema)
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, SCHEMA_CASES))
    assert len(answers) >= 20
    for case, response in answers:
        [choice] = response.choices
        assert choice.finish_reason == "stop", case.name
        jsonschema.validate(json.loads(choice.message.content), case.schema)
    server.wait_idle()


def test_json_object_mode_answers_an_object(server: RunningServer) -> None:
    response = chat(server, messages=ASK, max_tokens=48, response_format={"type": "json_object"})
    text = response.choices[0].message.content
    assert text.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_streamed_json_schema_equals_the_whole_answer(server: RunningServer) -> None:
    case = SCHEMA_CASES[6]
    kwargs: dict[str, Any] = {
        "messages": [{"role": "user", "content": case.prompt}],
        "response_format": json_schema_format(case.schema),
    }
    whole = chat(server, **kwargs).choices[0].message.content
    chunks = list(chat(server, stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


@pytest.mark.parametrize("case", SCHEMA_CASES[:12], ids=lambda c: c.name)
def test_required_tool_calls_validate_against_the_tool_schema(
    server: RunningServer, case: Any
) -> None:
    tool = {
        "type": "function",
        "function": {"name": f"submit_{case.name}", "parameters": case.schema},
    }
    messages = [{"role": "user", "content": case.prompt}]
    response = chat(
        server,
        messages=messages,
        tools=[tool, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    schemas = {f"submit_{case.name}": case.schema, "get_time": TIME["function"]["parameters"]}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_parallel_required_calls_end_and_validate(server: RunningServer) -> None:
    response = chat(server, messages=ASK, tools=[TIME], tool_choice="required")
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls"
    assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_named_tool_choice_calls_that_tool(server: RunningServer) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    response = chat(server, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    assert response.choices[0].message.content is None


def test_tool_round_trip(server: RunningServer) -> None:
    """call -> tool message -> answer; the second prompt renders the call and its result."""
    first = chat(
        server, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = chat(server, messages=history, tools=[WEATHER], max_tokens=12)
    [choice] = second.choices
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    # The prompt the engine saw: tool definitions, the call as Hermes writes it, the result.
    rendered = render_messages(
        [{"role": "user", "content": ASK[0]["content"]},
         {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
         {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'}],
        [WEATHER], HERMES, template_renders_tools=False,
    )  # fmt: skip
    text = server.tokenizer.render_chat(rendered)
    assert '"name": "get_weather"' in text and "<tool_response>" in text and "<tools>" in text
    assert second.usage is not None
    assert second.usage.prompt_tokens == len(server.tokenizer.encode_chat(rendered))


def _reassemble(chunks: list[Any]) -> tuple[str, list[dict[str, str]], str | None]:
    content, calls, finish = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a new call: index, id, type and name come first
                assert delta.index == len(calls) and delta.type == "function"
                assert delta.function.name and delta.function.arguments == ""
                calls.append({"name": delta.function.name, "arguments": ""})
            else:  # then only argument fragments
                assert delta.function.name is None and delta.function.arguments
                calls[delta.index]["arguments"] += delta.function.arguments
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(
    server: RunningServer, tool_choice: str
) -> None:
    kwargs: dict[str, Any] = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    whole = chat(server, **kwargs).choices[0]
    content, calls, finish = _reassemble(list(chat(server, stream=True, **kwargs)))
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls or []
    ]
    assert calls == expected
    assert content == (whole.message.content or "")
    assert finish == whole.finish_reason
    if tool_choice == "required":
        assert finish == "tool_calls" and len(calls) >= 1
        assert len(expected[0]["arguments"]) > 2


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
        ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ],
)
def test_unsupported_schema_features_are_a_400(
    server: RunningServer, schema: dict, keyword: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(server, messages=ASK, response_format=json_schema_format(schema))
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["param"] == "response_format.json_schema.schema"
    assert keyword in error["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(openai.BadRequestError) as raised:
        chat(server, messages=ASK, tools=[tool], tool_choice="required")
    assert raised.value.body["param"] == "tools[0].function.parameters"  # type: ignore[index]
    server.wait_idle()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        (
            {
                "response_format": json_schema_format({"type": "object"}),
                "extra_body": {"ignore_eos": True},
            },
            None,
        ),
    ],
)
def test_tool_requests_that_cannot_be_served_are_a_400(
    server: RunningServer, kwargs: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(server, messages=ASK, **kwargs)
    assert raised.value.body["param"] == param  # type: ignore[index]


def test_tool_choice_none_leaves_the_answer_unparsed(server: RunningServer) -> None:
    response = chat(server, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert response.choices[0].message.tool_calls is None
    assert response.usage is not None
    plain = chat(server, messages=ASK, max_tokens=8)
    assert response.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools rendered
