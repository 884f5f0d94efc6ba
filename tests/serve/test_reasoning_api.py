"""Reasoning and chat templates through the official `openai` client: `reasoning_content` in
responses and streamed deltas (R1 style: the template opened `<think>` in the prompt), tool calls
read from the content only, `chat_template_kwargs`, `reasoning_effort` and `--chat-template`.

The engine runs (its handshake, its tokenizer), but the answer's tokens are scripted: a random
tiny model does not reason, and the split must be seen on known text. The tiny model's tokenizer
spells `<think>` as several tokens, so markers arrive cut across outputs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from pydantic import BaseModel

from densa.engine.client import EngineClient
from densa.ipc.messages import AddRequest, RequestDelta
from densa.serve.state import ApiOptions
from densa.text.tokenizer import Tokenizer

from .support import MODEL_NAME, RunningServer, engine_client, running_server

# Opens <think> in the prompt (DeepSeek R1 style) unless enable_thinking is false, when it
# closes an empty one (Qwen3 style); shows an earlier turn's reasoning_content.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK: list[Any] = [{"role": "user", "content": "Is the sea salty?"}]
ANSWER = "The sea is salty, so\n</think>\n\nYes, it is salty."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ANTHROPIC_WEATHER: Any = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedAnswer(EngineClient):
    """Answers every request with `text`, `tokens_per_output` tokens per output."""

    text = ""
    tokens_per_output = 1
    tokenizer: Tokenizer | None = None

    async def generate(self, request: AddRequest) -> AsyncGenerator[RequestDelta, None]:
        assert self.tokenizer is not None
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        step = self.tokens_per_output
        for at in range(0, len(ids), step):
            last = at + step >= len(ids)
            yield RequestDelta(
                request.request_id, ids[at : at + step], finished=last,
                finish_reason="stop" if last else None,
                num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=at + step,
            )  # fmt: skip


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    client = engine_client(tiny_model_dir, ScriptedAnswer)
    assert isinstance(client, ScriptedAnswer)
    client.tokenizer = Tokenizer.from_dir(tiny_model_dir)
    api = ApiOptions(reasoning_parser="deepseek_r1", chat_template=TEMPLATE)
    with running_server(client, api=api) as running:
        yield running


@pytest.fixture
def scripted(reasoning_server: RunningServer) -> Iterator[ScriptedAnswer]:
    client = reasoning_server.engine
    assert isinstance(client, ScriptedAnswer)
    yield client
    client.text, client.tokens_per_output = "", 1


def reasoning_of(message: BaseModel) -> Any:
    return (message.model_extra or {}).get("reasoning_content")


def chat(server: RunningServer, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(model=MODEL_NAME, messages=ASK, **kwargs)


def streamed(server: RunningServer, **kwargs: Any) -> tuple[list[str], list[str], list[Any]]:
    """The reasoning and content deltas in order, and the tool-call deltas."""
    reasoning, content, calls = [], [], []
    for chunk in chat(server, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if reasoning_of(delta):
            assert not content, "reasoning after content"
            reasoning.append(reasoning_of(delta))
        if delta.content:
            content.append(delta.content)
        calls.extend(delta.tool_calls or [])
    return reasoning, content, calls


def test_the_answer_starts_inside_the_reasoning_the_template_opened(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    scripted.text = ANSWER
    message = chat(reasoning_server).choices[0].message
    assert reasoning_of(message) == "The sea is salty, so"
    assert message.content == "Yes, it is salty."


@pytest.mark.parametrize("tokens_per_output", [1, 2, 3])
def test_streamed_deltas_never_carry_a_piece_of_a_marker(
    reasoning_server: RunningServer, scripted: ScriptedAnswer, tokens_per_output: int
) -> None:
    scripted.text, scripted.tokens_per_output = ANSWER, tokens_per_output
    reasoning, content, _ = streamed(reasoning_server)
    assert "".join(reasoning) == "The sea is salty, so"
    assert "".join(content) == "Yes, it is salty."
    assert len(reasoning) > 1  # streamed as it came, not held to the end


def test_tool_calls_are_read_from_the_content_only(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    """A call written inside the reasoning is reasoning; the one after it is the call."""
    scripted.text = f"Maybe {CALL}? Yes.</think>{CALL}"
    message = chat(reasoning_server, tools=[WEATHER]).choices[0].message
    assert reasoning_of(message) == f"Maybe {CALL}? Yes."
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, content, calls = streamed(reasoning_server, tools=[WEATHER])
    assert "".join(reasoning) == f"Maybe {CALL}? Yes."
    assert "".join(content) == ""
    assert calls[0].function.name == "get_weather"


def test_chat_template_kwargs_reach_the_template(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    """enable_thinking: false closes an empty <think></think> in the prompt: the answer is all
    content, even text that looks like a marker."""
    scripted.text = "Plainly yes.</think>"
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    response = chat(reasoning_server, extra_body=off)
    assert reasoning_of(response.choices[0].message) is None
    assert response.choices[0].message.content == "Plainly yes.</think>"
    prompt = reasoning_server.tokenizer.render_chat(ASK, variables={"enable_thinking": False})
    assert prompt.endswith("<think></think>\n")
    assert response.usage.prompt_tokens == len(reasoning_server.tokenizer.encode(prompt, False))


def test_reasoning_effort_none_maps_to_the_thinking_switch(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    scripted.text = "Plainly yes."
    raw = reasoning_server.client().chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=ASK, reasoning_effort="none"
    )
    assert "x-densa-ignored-fields" not in raw.headers
    assert raw.parse().choices[0].message.content == "Plainly yes."
    with_thinking = chat(reasoning_server, reasoning_effort="high")  # the template cannot use it
    assert reasoning_of(with_thinking.choices[0].message) == "Plainly yes."


def test_reasoning_effort_a_template_cannot_use_is_ignored_by_name(
    server: RunningServer,
) -> None:
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=ASK, max_tokens=1, reasoning_effort="low"
    )
    assert raw.headers["x-densa-ignored-fields"] == "reasoning_effort"
    body = {"model": MODEL_NAME, "messages": ASK, "reasoning_effort": "extreme"}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [({"messages": []}, "set by the server"), ({"not a name": 1}, "not a template variable")],
)
def test_template_kwargs_cannot_replace_what_the_server_sets(
    server: RunningServer, kwargs: dict[str, Any], problem: str
) -> None:
    body = {"model": MODEL_NAME, "messages": ASK, "chat_template_kwargs": kwargs}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert problem in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_the_chat_template_option_replaces_the_models_template(
    reasoning_server: RunningServer,
) -> None:
    """--chat-template: the front renders it, and tells routers so they render it too."""
    info = httpx.get(reasoning_server.base_url + "/densa/info").json()
    assert info["tokenizer"]["chat_template"] == TEMPLATE
    assert reasoning_server.tokenizer.render_chat(ASK).endswith("assistant\n<think>\n")


# ---- the same split in Anthropic Messages and OpenAI Responses ----------------------------------
def anthropic_client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="test-key", max_retries=0)


def message(server: RunningServer, **kwargs: Any) -> Any:
    return anthropic_client(server).messages.create(
        model=MODEL_NAME, max_tokens=64, messages=ASK, **kwargs
    )


def test_a_message_puts_the_reasoning_in_a_first_thinking_block(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    scripted.text = ANSWER
    answer = message(reasoning_server, thinking={"type": "enabled", "budget_tokens": 1024})
    [thinking, text] = answer.content
    assert thinking.type == "thinking" and thinking.thinking == "The sea is salty, so"
    assert text.type == "text" and text.text == "Yes, it is salty."


@pytest.mark.parametrize("tokens_per_output", [1, 3])
def test_a_streamed_message_rebuilds_the_same_blocks(
    reasoning_server: RunningServer, scripted: ScriptedAnswer, tokens_per_output: int
) -> None:
    scripted.text, scripted.tokens_per_output = f"Maybe.</think>Checking.{CALL}", tokens_per_output
    with anthropic_client(reasoning_server).messages.stream(
        model=MODEL_NAME, max_tokens=64, messages=ASK, tools=[ANTHROPIC_WEATHER]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thinking_deltas = [e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta"]  # fmt: skip
    assert "".join(thinking_deltas) == "Maybe."
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Maybe." and final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    whole = message(reasoning_server, tools=[ANTHROPIC_WEATHER])
    assert [block.model_dump() for block in whole.content[:2]] == [
        block.model_dump() for block in final.content[:2]
    ]


def test_thinking_sent_back_reaches_the_template_and_disabled_turns_it_off(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    """An earlier turn's thinking block becomes its reasoning_content; `thinking: disabled` is
    the template's enable_thinking switch, and a budget the server cannot enforce is named."""
    scripted.text = "Plainly yes.</think>"
    turns: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Salt, yes.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Yes."},
        ]},
        {"role": "user", "content": "Why?"},
    ]  # fmt: skip
    raw = anthropic_client(reasoning_server).messages.with_raw_response.create(
        model=MODEL_NAME, max_tokens=64, messages=turns, thinking={"type": "disabled"}
    )
    answer = raw.parse()
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text == "Plainly yes.</think>"
    assert "x-densa-ignored-fields" not in raw.headers
    expected = reasoning_server.tokenizer.render_chat(
        [*ASK, {"role": "assistant", "content": "Yes.", "reasoning_content": "Salt, yes."},
         {"role": "user", "content": "Why?"}],
        variables={"enable_thinking": False},
    )  # fmt: skip
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == len(
        reasoning_server.tokenizer.encode(expected, False)
    )
    budget = anthropic_client(reasoning_server).messages.with_raw_response.create(
        model=MODEL_NAME, max_tokens=64, messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 2048},
    )  # fmt: skip
    assert budget.headers["x-densa-ignored-fields"] == "thinking.budget_tokens"


def test_a_response_puts_the_reasoning_in_a_first_reasoning_item(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    scripted.text = ANSWER
    response = reasoning_server.client().responses.create(model=MODEL_NAME, input=ASK)
    [reasoning, answer] = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [part.text for part in reasoning.content] == ["The sea is salty, so"]
    assert answer.type == "message" and answer.content[0].text == "Yes, it is salty."
    assert response.output_text == "Yes, it is salty."


@pytest.mark.parametrize("tokens_per_output", [1, 3])
def test_a_streamed_response_streams_its_reasoning_first(
    reasoning_server: RunningServer, scripted: ScriptedAnswer, tokens_per_output: int
) -> None:
    scripted.text, scripted.tokens_per_output = f"Maybe.</think>{CALL}", tokens_per_output
    tools: list[Any] = [{"type": "function", **WEATHER["function"]}]
    events = list(
        reasoning_server.client().responses.create(
            model=MODEL_NAME, input=ASK, tools=tools, stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Maybe."
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == "Maybe." and done.output_index == 0
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == "Maybe."
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_reasoning_items_sent_back_open_the_assistant_turn(
    reasoning_server: RunningServer, scripted: ScriptedAnswer
) -> None:
    scripted.text = "Because of salt."
    turns: list[Any] = [
        *ASK,
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Salt, yes."}]},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Why?"},
    ]  # fmt: skip
    response = reasoning_server.client().responses.create(model=MODEL_NAME, input=turns)
    expected = reasoning_server.tokenizer.render_chat(
        [*ASK, {"role": "assistant", "content": "Yes.", "reasoning_content": "Salt, yes."},
         {"role": "user", "content": "Why?"}]
    )  # fmt: skip
    assert response.usage.input_tokens == len(reasoning_server.tokenizer.encode(expected, False))
