"""Anthropic Messages (/v1/messages) through the official `anthropic` client, on a live server:
the answers are the chat route's (same prompt, same greedy text, same usage), stop sequences,
the streamed events reassembled by the SDK, a forced tool_use -> tool_result -> answer round
trip, prefix-cache reads in usage, count_tokens, x-api-key auth, and Anthropic-shaped errors
(before a response and in the middle of a stream)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import jsonschema
import pytest

from .support import MODEL_NAME, RunningServer, ScriptedClient

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": WEATHER_SCHEMA}  # fmt: skip
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK no longer types `temperature` (Claude's newest models refuse it); densa takes it.
GREEDY: dict[str, Any] = {"model": MODEL_NAME, "extra_body": {"temperature": 0}}


@pytest.fixture(autouse=True)
def _only_the_key_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client would also send ANTHROPIC_AUTH_TOKEN from the environment as a bearer key."""
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)


def client(server: RunningServer, api_key: str = "test-key") -> anthropic.Anthropic:
    # No retries: a test that expects an error must see the first answer.
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0)


def create(server: RunningServer, **kwargs: Any) -> Any:
    return client(server).messages.create(**(GREEDY | {"max_tokens": 24} | kwargs))


def chat(server: RunningServer, messages: list[Any], **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, **kwargs
    )


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def fresh_user() -> dict[str, str]:
    """metadata.user_id narrows the prefix-cache scope: a new one starts with an empty cache."""
    return {"user_id": uuid.uuid4().hex}


def test_a_message_is_the_chat_answer(server: RunningServer) -> None:
    message = create(server, messages=ASK, metadata=fresh_user())
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg-") and message.model == MODEL_NAME
    same = chat(server, ASK, max_tokens=24)
    assert text_of(message) == (same.choices[0].message.content or "")
    assert [block.type for block in message.content] == ["text"] and text_of(message)
    expected_stop = {"length": "max_tokens", "stop": "end_turn"}[same.choices[0].finish_reason]
    assert message.stop_reason == expected_stop and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == same.usage.prompt_tokens
    assert usage.input_tokens == len(server.tokenizer.encode_chat(ASK))  # a fresh cache scope
    assert usage.output_tokens == same.usage.completion_tokens
    assert usage.cache_creation_input_tokens == 0


def test_system_as_text_or_blocks_is_the_system_message(server: RunningServer) -> None:
    system = "You answer in one word."
    as_text = create(server, messages=ASK, system=system)
    as_blocks = create(server, messages=ASK, system=[{"type": "text", "text": system}])
    same = chat(server, [{"role": "system", "content": system}, *ASK], max_tokens=24)
    assert text_of(as_text) == text_of(as_blocks) == (same.choices[0].message.content or "")
    prompt = as_blocks.usage.input_tokens + as_blocks.usage.cache_read_input_tokens
    assert prompt == same.usage.prompt_tokens


def test_a_stop_sequence_ends_the_answer_and_is_named(server: RunningServer) -> None:
    whole = text_of(create(server, messages=ASK, max_tokens=40))
    words = whole.split()
    assert len(words) >= 4, f"the tiny model's answer is too short for this test: {whole!r}"
    stop = words[2]
    message = create(server, messages=ASK, max_tokens=40, stop_sequences=["zzq-never", stop])
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert text_of(message) == whole[: whole.index(stop)]


def test_the_stream_reassembles_to_the_whole_message(server: RunningServer) -> None:
    whole = create(server, messages=ASK, max_tokens=32)
    with client(server).messages.stream(**GREEDY, max_tokens=32, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    raw = [k for k in kinds if k in ("content_block_start", "content_block_delta",
                                     "content_block_stop")]  # fmt: skip
    assert raw[0] == "content_block_start" and raw[-1] == "content_block_stop"
    assert set(raw[1:-1]) == {"content_block_delta"}  # one text block
    assert text_of(final) == text_of(whole) != ""
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt


def test_a_forced_tool_use_round_trip(server: RunningServer) -> None:
    """tool_choice {"type": "tool"} -> a valid tool_use block -> tool_result -> an answer."""
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = create(server, messages=ASK, tools=[WEATHER], tool_choice=forced, max_tokens=80)
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    history = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'},
        ]},
    ]  # fmt: skip
    second = create(server, messages=history, tools=[WEATHER], max_tokens=12)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.content
    # The same conversation in chat's words renders the same prompt.
    arguments = json.dumps(call.input, ensure_ascii=False)
    openai_history = [
        *ASK,
        {"role": "assistant", "content": text_of(first) or None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]  # fmt: skip
    tool = {"type": "function", "function": {"name": "get_weather",
            "description": WEATHER["description"], "parameters": WEATHER_SCHEMA}}  # fmt: skip
    same = chat(server, openai_history, tools=[tool], max_tokens=12)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == (
        same.usage.prompt_tokens
    )


def test_a_streamed_tool_use_streams_its_input_json(server: RunningServer) -> None:
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    kwargs: dict[str, Any] = {"messages": ASK, "tools": [WEATHER], "tool_choice": forced}
    whole = create(server, max_tokens=80, **kwargs)
    with client(server).messages.stream(**GREEDY, max_tokens=80, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    json_deltas = [e.delta.partial_json for e in events
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]  # fmt: skip
    assert len(json_deltas) >= 1
    [call] = [block for block in final.content if block.type == "tool_use"]
    assert json.loads("".join(json_deltas)) == call.input
    [whole_call] = [block for block in whole.content if block.type == "tool_use"]
    assert call.input == whole_call.input and call.name == whole_call.name
    assert final.stop_reason == "tool_use"


def test_a_repeated_prompt_reads_the_prefix_cache(server: RunningServer) -> None:
    user = fresh_user()
    long_ask = [{"role": "user", "content": "word " * 80}]
    first = create(server, messages=long_ask, max_tokens=1, metadata=user)
    second = create(server, messages=long_ask, max_tokens=1, metadata=user)
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= 64
    total = first.usage.input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total


def test_count_tokens_is_the_prompt_a_message_reads(server: RunningServer) -> None:
    kwargs: dict[str, Any] = {"messages": ASK, "system": "Be brief.", "tools": [WEATHER]}
    counted = client(server).messages.count_tokens(model=MODEL_NAME, **kwargs)
    message = create(server, max_tokens=1, **kwargs)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    without_tools = client(server).messages.count_tokens(model=MODEL_NAME, messages=ASK)
    assert counted.input_tokens > without_tools.input_tokens  # the tools are part of the prompt


def test_x_api_key_is_checked_like_a_bearer_key(
    server: RunningServer, api_keys: Callable[..., None]
) -> None:
    api_keys("key-one")
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client(server, api_key="wrong").messages.create(**GREEDY, max_tokens=1, messages=ASK)
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "incorrect API key provided; "
                  "pass a key this server accepts"},
    }  # fmt: skip
    message = client(server, api_key="key-one").messages.create(
        **GREEDY, max_tokens=1, messages=ASK
    )
    assert message.usage.output_tokens == 1
    assert server.client(api_key="key-one").models.list().data  # the same key as a bearer key


def _post(server: RunningServer, body: dict[str, Any], path: str = "/v1/messages") -> Any:
    return client(server).post(path, body=body, cast_to=anthropic.types.Message)


@pytest.mark.parametrize(
    ("body", "status", "error_type", "words"),
    [
        ({"model": MODEL_NAME, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "claude-x", "max_tokens": 1, "messages": ASK}, 404, "not_found_error",
         "claude-x"),
        ({"model": MODEL_NAME, "max_tokens": 1, "messages": ASK,
          "thinking": {"type": "sometimes"}}, 400, "invalid_request_error", "thinking"),
        ({"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "thinking", "thinking": "t", "signature": ""}]}]}, 400,
         "invalid_request_error", "assistant"),
        ({"model": MODEL_NAME, "max_tokens": 1, "messages": ASK,
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
         "invalid_request_error", "server tools"),
        ({"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400,
         "invalid_request_error", "assistant"),
        ({"model": MODEL_NAME, "max_tokens": 1, "messages": ASK, "tool_choice": {"type": "any"}},
         400, "invalid_request_error", "tool_choice needs tools"),
        ({"model": MODEL_NAME, "max_tokens": 100000, "messages": ASK}, 400,
         "invalid_request_error", "context"),
    ],
)  # fmt: skip
def test_errors_have_anthropics_shape(
    server: RunningServer, body: dict[str, Any], status: int, error_type: str, words: str
) -> None:
    with pytest.raises(anthropic.APIStatusError) as raised:
        _post(server, body)
    assert raised.value.status_code == status
    error = raised.value.body
    assert isinstance(error, dict) and error["type"] == "error"
    assert error["error"]["type"] == error_type
    assert words in error["error"]["message"]


def test_the_openai_routes_keep_openais_error_shape(server: RunningServer) -> None:
    with pytest.raises(anthropic.APIStatusError) as raised:
        _post(server, {"model": MODEL_NAME}, path="/v1/chat/completions")
    assert raised.value.status_code == 400
    assert raised.value.body["error"]["param"] == "messages"  # type: ignore[index]


def test_an_engine_failure_mid_stream_is_an_error_event(
    limited_server: RunningServer, scripted: ScriptedClient
) -> None:
    scripted.fail_after = 2
    messages = client(limited_server).messages
    seen: list[str] = []
    with (
        pytest.raises(anthropic.APIStatusError) as raised,
        messages.stream(**GREEDY, max_tokens=16, messages=ASK) as stream,
    ):
        seen.extend(event.type for event in stream)
    assert seen[0] == "message_start"
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "api_error",
                  "message": "kv_integrity_violation: page 3 was reallocated under this request"},
    }  # fmt: skip
