"""The Anthropic Messages and OpenAI Responses translations without a server: requests into the
exact chat requests, and generated text into blocks that stream to the whole answer in any
chunking (the live-server tests are test_anthropic_messages.py and test_openai_responses.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from densa.openai.anthropic_api.formatter import stop_info
from densa.openai.anthropic_api.models import MessagesRequest
from densa.openai.anthropic_api.to_chat import to_chat_request as anthropic_to_chat
from densa.openai.blocks import Block, BlockDelta, BlockStart, BlockStop, BlockStream, whole_blocks
from densa.openai.errors import APIError
from densa.openai.prepare import parse
from densa.openai.responses_api.models import ResponsesRequest
from densa.openai.responses_api.to_chat import to_chat_request as responses_to_chat
from densa.openai.tools.formats import HERMES
from densa.text.output import RequestOutput

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}"


def _chat(request: Any) -> dict[str, Any]:
    return request.model_dump(exclude_unset=True, exclude_none=True, by_alias=True)


def test_anthropic_blocks_become_chat_messages() -> None:
    body = parse(MessagesRequest, {
        "model": "m", "max_tokens": 9, "stop_sequences": ["END"], "temperature": 0.5, "top_k": 4,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no station"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    })  # fmt: skip
    chat = _chat(anthropic_to_chat(body))
    assert chat == {
        "model": "m", "max_tokens": 9, "stop": ["END"], "temperature": 0.5, "top_k": 4,
        "user": "u1", "stream": False,
        "messages": [
            {"role": "system", "content": "Be brief.\nBe kind."},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "toolu_2", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "error: no station"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}}}],
        "tool_choice": "required", "parallel_tool_calls": False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_anthropic_tool_choices(choice: dict[str, Any], expected: Any) -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    body = parse(MessagesRequest, {"model": "m", "max_tokens": 1, "tools": [tool],
                                   "messages": [{"role": "user", "content": "x"}],
                                   "tool_choice": choice})  # fmt: skip
    assert _chat(anthropic_to_chat(body))["tool_choice"] == expected


def test_a_named_anthropic_tool_choice_needs_its_name() -> None:
    with pytest.raises(APIError) as raised:
        parse(MessagesRequest, {"model": "m", "max_tokens": 1, "tool_choice": {"type": "tool"},
                                "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
    assert raised.value.status_code == 400 and "tool_choice" in raised.value.info.message


def test_responses_items_become_chat_messages() -> None:
    body = parse(ResponsesRequest, {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "top_p": 0.5,
        "user": "u1", "prompt_cache_key": "s1", "store": False,
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
            {"type": "function_call_output", "call_id": "call_2", "output": "9C"},
            {"role": "user", "content": [{"type": "input_text", "text": "And"},
                                         {"type": "input_text", "text": "tomorrow?"}]},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    })  # fmt: skip
    chat = _chat(responses_to_chat(body))
    assert chat == {
        "model": "m", "max_tokens": 9, "top_p": 0.5, "user": "u1", "prompt_cache_key": "s1",
        "stream": False,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "9C"},
            {"role": "user", "content": "And\ntomorrow?"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "w", "schema": {"type": "object"}}},
    }  # fmt: skip


def test_a_bare_string_input_is_one_user_message() -> None:
    chat = _chat(responses_to_chat(parse(ResponsesRequest, {"model": "m", "input": "hi"})))
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


def test_blocks_of_an_answer_in_order() -> None:
    blocks = whole_blocks(HERMES, ANSWER)
    assert [(b.kind, b.name, b.text) for b in blocks] == [
        ("text", "", "Let me check."),
        ("call", "get_weather", '{"city": "Paris"}'),
        ("call", "get_weather", '{"city": "Oslo"}'),
    ]
    assert blocks[1].call_id.startswith("call_") and blocks[1].call_id != blocks[2].call_id
    assert whole_blocks(None, ANSWER) == [Block("text", ANSWER)]  # no tools offered: all text
    assert whole_blocks(HERMES, "") == []


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 13, len(ANSWER)])
def test_streamed_blocks_rebuild_the_whole_answer_in_any_chunking(chunk: int) -> None:
    stream = BlockStream(HERMES)
    events = []
    for start in range(0, len(ANSWER), chunk):
        events += stream.feed(ANSWER[start : start + chunk])
    events += stream.feed("", finished=True)
    rebuilt: list[list[str]] = []
    open_idx = None
    for event in events:
        if isinstance(event, BlockStart):
            assert open_idx is None and event.index == len(rebuilt)  # one block open at a time
            rebuilt.append([event.kind, event.name, ""])
            open_idx = event.index
        elif isinstance(event, BlockDelta):
            assert event.index == open_idx and event.text
            rebuilt[event.index][2] += event.text
        else:
            assert isinstance(event, BlockStop) and event.index == open_idx
            open_idx = None
    assert open_idx is None
    whole = [[b.kind, b.name, b.text] for b in whole_blocks(HERMES, ANSWER)]
    assert rebuilt == whole
    assert json.loads(rebuilt[1][2]) == {"city": "Paris"}
    assert stream.num_calls == 2


@pytest.mark.parametrize(
    ("finish_reason", "stop_string", "num_calls", "expected"),
    [
        ("stop", None, 0, ("end_turn", None)),
        ("stop", None, 2, ("tool_use", None)),
        ("stop", "END", 0, ("stop_sequence", "END")),
        ("length", None, 1, ("max_tokens", None)),
        ("abort", None, 0, ("pause_turn", None)),
    ],
)
def test_anthropic_stop_reasons(
    finish_reason: str, stop_string: str | None, num_calls: int, expected: tuple[Any, Any]
) -> None:
    final = RequestOutput("r", [], "", finished=True, finish_reason=finish_reason,
                          stop_string=stop_string)  # fmt: skip
    info = stop_info(final, num_calls)
    assert (info.stop_reason, info.stop_sequence) == expected
