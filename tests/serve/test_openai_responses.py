"""OpenAI Responses (/v1/responses, the stateless subset) through the official `openai` client,
on a live server: the answers are the chat route's (same prompt, same greedy text, same usage),
instructions, the streamed events (numbered, in order, reassembled by the SDK's own stream
helper), a forced function_call -> function_call_output -> answer round trip, max_output_tokens,
prefix-cache reads in usage, and 400s for what needs server-side state."""

from __future__ import annotations

import json
import uuid
from typing import Any

import jsonschema
import openai
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
# Responses' flat tool shape: name and parameters at the top level.
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": WEATHER_SCHEMA}  # fmt: skip
QUESTION = "What is the weather in Paris?"
ASK: list[Any] = [{"role": "user", "content": QUESTION}]
GREEDY: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0}


def create(server: RunningServer, **kwargs: Any) -> Any:
    return server.client().responses.create(**(GREEDY | {"max_output_tokens": 24} | kwargs))


def chat(server: RunningServer, messages: list[Any], **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, **kwargs
    )


def test_a_response_is_the_chat_answer(server: RunningServer) -> None:
    response = create(server, input=QUESTION, user=uuid.uuid4().hex)
    assert response.object == "response" and response.id.startswith("resp-")
    assert response.model == MODEL_NAME and response.error is None
    same = chat(server, ASK, max_tokens=24)
    assert response.output_text == (same.choices[0].message.content or "")
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and response.output_text
    assert item.id.startswith("msg_")
    assert [part.type for part in item.content] == ["output_text"]
    if same.choices[0].finish_reason == "length":
        assert response.status == item.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == item.status == "completed"
        assert response.incomplete_details is None
    usage = response.usage
    assert usage.input_tokens == same.usage.prompt_tokens == len(server.tokenizer.encode_chat(ASK))
    assert usage.input_tokens_details.cached_tokens == 0  # a fresh cache scope (user)
    assert usage.output_tokens == same.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_input_items_and_instructions_are_the_chat_messages(server: RunningServer) -> None:
    instructions = "You answer in one word."
    as_text = create(server, input=QUESTION, instructions=instructions)
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": QUESTION}]}]  # fmt: skip
    as_items = create(server, input=items, instructions=instructions)
    same = chat(server, [{"role": "system", "content": instructions}, *ASK], max_tokens=24)
    assert as_text.output_text == as_items.output_text == (same.choices[0].message.content or "")
    assert as_items.usage.input_tokens == same.usage.prompt_tokens
    assert as_items.instructions == instructions  # the request's settings are echoed back


def _check_sequence(events: list[Any]) -> None:
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_streamed_events_rebuild_the_whole_response(server: RunningServer) -> None:
    whole = create(server, input=QUESTION, max_output_tokens=40)
    events = list(create(server, input=QUESTION, max_output_tokens=40, stream=True))
    _check_sequence(events)
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]  # fmt: skip
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert done.text == whole.output_text != ""
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's stream helper checks every event against the ones before it.
    with server.client().responses.stream(**GREEDY, input=QUESTION, max_output_tokens=40) as stream:
        assert [event.type for event in stream] == kinds


def test_max_output_tokens_makes_an_incomplete_response(server: RunningServer) -> None:
    response = create(server, input=QUESTION, max_output_tokens=2)
    assert response.usage.output_tokens == 2
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.status == "incomplete" and item.content[0].text == response.output_text
    events = list(create(server, input=QUESTION, max_output_tokens=2, stream=True))
    _check_sequence(events)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    [done] = [event for event in events if event.type == "response.output_item.done"]
    assert done.item.status == "incomplete"
    assert events[-1].response.output_text == response.output_text


def test_a_forced_function_call_round_trip(server: RunningServer) -> None:
    """tool_choice {function} -> a valid function_call item -> function_call_output -> an
    answer; the earlier output items go back in `input` as they came."""
    forced = {"type": "function", "name": "get_weather"}
    first = create(server, input=ASK, tools=[WEATHER], tool_choice=forced,
                   parallel_tool_calls=False, max_output_tokens=80)  # fmt: skip
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    result = '{"temperature": 21}'
    history = [*ASK, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": result}]  # fmt: skip
    second = create(server, input=history, tools=[WEATHER], max_output_tokens=12)
    assert second.output
    # The same conversation in chat's words renders the same prompt.
    tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    openai_history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]  # fmt: skip
    same = chat(server, openai_history, tools=[tool], max_tokens=12)
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.output_text == (same.choices[0].message.content or "")


def test_a_streamed_function_call_streams_its_arguments(server: RunningServer) -> None:
    kwargs: dict[str, Any] = {"input": ASK, "tools": [WEATHER], "tool_choice": "required",
                              "parallel_tool_calls": False, "max_output_tokens": 80}  # fmt: skip
    whole = create(server, **kwargs)
    events = list(create(server, stream=True, **kwargs))
    _check_sequence(events)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == [item.type for item in whole.output]
    [call] = [e.item for e in added if e.item.type == "function_call"]
    assert call.arguments == "" and call.status == "in_progress"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [whole_call] = [item for item in whole.output if item.type == "function_call"]
    assert "".join(deltas) == done.arguments == whole_call.arguments
    assert done.name == whole_call.name
    assert events[-1].type == "response.completed"
    with server.client().responses.stream(**GREEDY, **kwargs) as stream:
        list(stream)
        final = stream.get_final_response()
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert streamed_call.arguments == whole_call.arguments


def test_a_repeated_prompt_reports_cached_tokens(server: RunningServer) -> None:
    user = uuid.uuid4().hex
    first = create(server, input="word " * 80, max_output_tokens=1, user=user)
    second = create(server, input="word " * 80, max_output_tokens=1, user=user)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens >= 64
    assert second.usage.input_tokens == first.usage.input_tokens


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"previous_response_id": "resp-1"}, "stateless"),
        ({"store": True}, "stateless"),
        ({"input": [{"type": "input_image", "image_url": "data:,"}]}, "input items"),
        ({"tools": [{"type": "web_search"}]}, "built-in tools"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"model": "gpt-x"}, "gpt-x"),
    ],
)
def test_what_cannot_be_served_is_refused(
    server: RunningServer, kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        create(server, **({"input": QUESTION} | kwargs))
    assert raised.value.status_code == (404 if "model" in kwargs else 400)
    assert words in raised.value.body["message"]  # type: ignore[index]


def test_store_false_is_accepted(server: RunningServer) -> None:
    assert create(server, input=QUESTION, store=False, max_output_tokens=1).store is False


def test_an_engine_failure_mid_stream_is_a_failed_response(
    limited_server: RunningServer, scripted: ScriptedClient
) -> None:
    scripted.fail_after = 2
    events = list(
        limited_server.client().responses.create(
            **GREEDY, input=QUESTION, max_output_tokens=16, stream=True
        )
    )
    assert events[0].type == "response.created"
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "kv_integrity_violation"
    assert [event.sequence_number for event in events] == list(range(len(events)))
