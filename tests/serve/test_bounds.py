"""Bounded requests, tried as an attacker would, against a real worker and a real router in front
of it (both on loopback): text too long for any prompt is refused before anything renders or
tokenizes it, wherever in the body it hides; stop_token_ids are bounded; a header that is
almost a number is not a 500; a constraint that matches nothing is the client's 400.

The size check sums every part of a body that becomes prompt text (docs/serving.md "Errors"):
message content, names, reasoning and tool calls, tool definitions, template variables, and
what Anthropic's and the Responses API's fields translate to.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from densa.openai.prepare import max_prompt_bytes
from densa.router.app import build_router_app
from densa.router.config import RouterConfig
from densa.sampling_params import MAX_STOP_TOKEN_IDS
from densa.serve.process import serve_in_thread
from densa.text.tokenizer import Tokenizer

from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
COUNT_TOKENS, TOKENIZE, COMPLETIONS = "/v1/messages/count_tokens", "/tokenize", "/v1/completions"
USER = {"role": "user", "content": "What is the weather?"}


@pytest.fixture(scope="module")
def router_url(server: RunningServer) -> Iterator[str]:
    """A real router in front of the shared worker, once it has learned the worker's model."""
    app = build_router_app(RouterConfig(workers=(server.base_url,)))
    with serve_in_thread(app) as url:
        state = app.state.router
        deadline = time.monotonic() + 30
        while state.router.model is None:
            assert time.monotonic() < deadline, "the router learned no model"
            time.sleep(0.05)
        yield url


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the texts any tokenizer in this process rendered or encoded (the worker's front
    and the router's both run here)."""
    seen: list[int] = []
    encode, render = Tokenizer.encode, Tokenizer.render_chat

    def counting_encode(self: Tokenizer, text: str, *args: Any) -> list[int]:
        seen.append(len(text))
        return encode(self, text, *args)

    def counting_render(self: Tokenizer, messages: Any, *args: Any) -> str:
        seen.append(len(json.dumps(messages)))
        return render(self, messages, *args)

    monkeypatch.setattr(Tokenizer, "encode", counting_encode)
    monkeypatch.setattr(Tokenizer, "render_chat", counting_render)
    return seen


def huge(server: RunningServer) -> str:
    """One byte more text than any prompt of the served model can hold."""
    return "x" * (max_prompt_bytes(MAX_MODEL_LEN, server.tokenizer.max_token_bytes) + 1)


def tool(description: str = "the weather", parameters: Any = None) -> dict[str, Any]:
    schema = parameters or {"type": "object", "properties": {"city": {"type": "string"}}}
    return {"type": "function",
            "function": {"name": "weather", "description": description, "parameters": schema}}  # fmt: skip


def called(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [USER], "max_tokens": 2, **fields}


def anthropic(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 2, "messages": [USER], **fields}


def responses(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_output_tokens": 16, "input": "Hi", **fields}


# Each: (endpoint, body with the text `h` hidden somewhere the old size check did not look).
Body = Callable[[str], dict[str, Any]]
HIDDEN: dict[str, tuple[str, Body]] = {
    "chat tool description": (CHAT, lambda h: chat(tools=[tool(h)])),
    "chat tool parameters": (CHAT, lambda h: chat(tools=[tool(parameters={
        "type": "object", "properties": {"city": {"type": "string", "description": h}}})])),
    "chat tool-call arguments": (CHAT, lambda h: chat(messages=called(json.dumps({"city": h})))),
    "chat reasoning": (CHAT, lambda h: chat(messages=[
        USER, {"role": "assistant", "content": "ok", "reasoning_content": h}, USER])),
    "chat template variables": (CHAT, lambda h: chat(chat_template_kwargs={"note": h})),
    "chat split over messages and tools": (CHAT, lambda h: chat(
        messages=[{"role": "user", "content": h[: len(h) // 2]}],
        tools=[tool(h[len(h) // 2 :])])),
    "anthropic system": (MESSAGES, lambda h: anthropic(system=h)),
    "anthropic tools": (MESSAGES, lambda h: anthropic(tools=[
        {"name": "weather", "description": h, "input_schema": {"type": "object"}}])),
    "anthropic tool_use input": (MESSAGES, lambda h: anthropic(messages=[
        USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": h}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
        tools=[{"name": "weather", "input_schema": {"type": "object"}}])),
    "anthropic count_tokens tools": (COUNT_TOKENS, lambda h: {
        "model": MODEL_NAME, "messages": [USER],
        "tools": [{"name": "weather", "description": h, "input_schema": {"type": "object"}}]}),
    "responses instructions": (RESPONSES, lambda h: responses(instructions=h)),
    "responses function_call item": (RESPONSES, lambda h: responses(input=[
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "weather",
         "arguments": json.dumps({"city": h})},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])),
    "responses tools": (RESPONSES, lambda h: responses(tools=[
        {"type": "function", "name": "weather", "description": h,
         "parameters": {"type": "object"}}])),
    "tokenize chat tools": (TOKENIZE, lambda h: {"messages": [USER], "tools": [tool(h)]}),
}  # fmt: skip
ROUTED = {CHAT, MESSAGES, RESPONSES}  # what the router serves (and tokenizes) itself


@pytest.mark.parametrize("via", ["worker", "router"])
@pytest.mark.parametrize("case", list(HIDDEN))
def test_prompt_text_anywhere_in_a_body_is_refused_before_it_is_tokenized(
    server: RunningServer, router_url: str, tokenized: list[int], case: str, via: str
) -> None:
    endpoint, body = HIDDEN[case]
    if via == "router" and endpoint not in ROUTED:
        pytest.skip(f"the router does not serve {endpoint}")
    base = server.base_url if via == "worker" else router_url
    text = huge(server)
    engine_before = server.stats
    response = httpx.post(base + endpoint, json=body(text), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    if endpoint not in (MESSAGES, COUNT_TOKENS):  # Anthropic's error shape has no code
        assert error["code"] == "context_length_exceeded", error
    assert "more than this model's" in error["message"], error
    assert tokenized == [], f"{case}: the tokenizer saw {max(tokenized)} characters"
    assert server.stats == engine_before  # refused in front: the engine never saw it


@pytest.mark.parametrize("case", list(HIDDEN))
def test_the_same_bodies_with_short_text_are_served(
    server: RunningServer, router_url: str, case: str
) -> None:
    """The check counts only what can fit: the same shapes with a few words pass, via both."""
    endpoint, body = HIDDEN[case]
    for base in (server.base_url, router_url) if endpoint in ROUTED else (server.base_url,):
        response = httpx.post(base + endpoint, json=body("a few words"), timeout=60)
        assert response.status_code == 200, (base, response.text)


# ---- stop_token_ids ------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_stop_token_ids_past_the_bound_are_a_400_naming_the_field(
    server: RunningServer, endpoint: str
) -> None:
    base = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0}
    base |= {"messages": [USER]} if endpoint == CHAT else {"prompt": "Hi"}
    at_bound = httpx.post(server.base_url + endpoint, timeout=30,
                          json={**base, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))})  # fmt: skip
    assert at_bound.status_code == 200, at_bound.text
    server.wait_idle()
    engine_before = server.stats
    for num_ids in (MAX_STOP_TOKEN_IDS + 1, 450_000):  # the issue's: a 900 kB body
        body = {**base, "stop_token_ids": [7] * num_ids, "n": 4, "stream": True}
        response = httpx.post(server.base_url + endpoint, json=body, timeout=30)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "stop_token_ids"), error
    assert server.stats == engine_before


# ---- headers that are almost numbers ------------------------------------------------------------
@pytest.mark.parametrize("length", ["\u00b2", "\u0661\u0662"])  # str.isdigit() says yes to both
def test_a_content_length_of_non_ascii_digits_is_refused_not_a_500(
    server: RunningServer, length: str
) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: " + length.encode()
                     + b"\r\n\r\n{}")  # fmt: skip
        status = sock.recv(4096).split(b"\r\n", 1)[0]
    assert status.split()[1].startswith(b"4"), status


# ---- a constraint that matches nothing ---------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("regex", ["[^\\s\\S]", "[a&&b]", "ab[^\\x00-\\x{10FFFF}]"])
def test_a_regex_no_text_matches_is_the_clients_400_not_a_500(
    server: RunningServer, regex: str, stream: bool
) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "stream": stream,
            "structured_outputs": {"regex": regex}}  # fmt: skip
    response = httpx.post(server.base_url + COMPLETIONS, json=body, timeout=30)
    if stream and response.status_code == 200:  # refused after the stream began: an event
        error = json.loads(response.text.split("data: ", 1)[1].split("\n", 1)[0])["error"]
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    assert error["code"] == "invalid_grammar", error
