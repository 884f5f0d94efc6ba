"""Every way a request can fail: exact status, OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from densa.engine.client import EngineShuttingDown
from densa.serve import build_app
from densa.serve.api_server import start_draining

from .conftest import SlowDown
from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer, ScriptedClient, engine_client

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    body.update(overrides)
    return body


def post(server: RunningServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=30, **kwargs)


def assert_error(
    response: httpx.Response, status: int, code: str | None, param: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.fixture(autouse=True)
def still_serving(server: RunningServer) -> Any:
    """After each bad request the server must still be healthy and idle."""
    yield
    assert httpx.get(server.base_url + "/health").status_code == 200
    server.wait_idle()


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b'{"model": "tiny", "messages": [', "invalid_json"),
        (b'{"model": "tiny", "temperature": NaN}', "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'{"model": "\xff\xfe"}', "invalid_encoding"),
    ],
)
def test_unreadable_bodies(server: RunningServer, content: bytes, code: str) -> None:
    assert_error(post(server, CHAT, content=content), 400, code)


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"n": 17}, "n"),
        ({"stop": ["ok", 3]}, "stop[1]"),
        ({"stop": [""]}, "stop[0]"),
        ({"seed": 2**70}, "seed"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"stream": "maybe"}, "stream"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({"messages": "hi"}, "messages"),
        ({"repetition_penalty": 1e-320}, "repetition_penalty"),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_invalid_chat_fields(server: RunningServer, overrides: dict[str, Any], param: str) -> None:
    error = assert_error(post(server, CHAT, json=chat_body(**overrides)), 400, "invalid_value")
    if param is not None:
        assert error["param"] == param
        assert param in error["message"]


def test_missing_field(server: RunningServer) -> None:
    body = chat_body()
    del body["messages"]
    assert_error(post(server, CHAT, json=body), 400, "missing_required_parameter", "messages")


def test_top_logprobs_needs_logprobs(server: RunningServer) -> None:
    error = assert_error(post(server, CHAT, json=chat_body(top_logprobs=2)), 400, "invalid_value")
    assert "logprobs" in error["message"]


@pytest.mark.parametrize(
    ("prompt", "code"),
    [
        (["one", "two"], "invalid_value"),
        ([[1, 2], [3]], "invalid_value"),
        (["text", 5], "invalid_value"),
        ("", "invalid_value"),
        ([], "invalid_value"),
        ([10**9], "invalid_value"),  # outside the vocabulary: the engine refuses it
    ],
)
def test_invalid_completion_prompts(server: RunningServer, prompt: Any, code: str) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    assert_error(post(server, COMPLETIONS, json=body), 400, code)


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"max_tokens": 0}, None),  # only with echo (tests/serve/test_echo.py)
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, None),  # the chat spelling; legacy logprobs is a count
        ({"prompt": None}, "prompt"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ],
)
def test_invalid_completion_fields(
    server: RunningServer, overrides: dict[str, Any], param: str | None
) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **overrides}
    assert_error(post(server, COMPLETIONS, json=body), 400, "invalid_value", param)


def test_engine_not_running(tiny_model_dir: Path) -> None:
    """An app whose engine has not started: /health and requests answer 503, not a hang."""
    app = build_app(engine_client(tiny_model_dir))
    client = TestClient(app)  # not entered: the lifespan never runs, the engine never starts
    assert_error(client.get("/health"), 503, "engine_not_running")  # type: ignore[arg-type]
    response = client.post(CHAT, json=chat_body())
    assert_error(response, 503, "engine_not_running")  # type: ignore[arg-type]


def test_unknown_model(server: RunningServer) -> None:
    for path, body in [
        (CHAT, chat_body(model="gpt-9")),
        (COMPLETIONS, {"model": "x", "prompt": "a"}),
    ]:
        assert_error(post(server, path, json=body), 404, "model_not_found", "model")
    assert_error(httpx.get(server.base_url + "/v1/models/gpt-9"), 404, "model_not_found")


def test_prompt_longer_than_the_context(server: RunningServer) -> None:
    long_chat = chat_body(messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}])
    error = assert_error(post(server, CHAT, json=long_chat), 400, "context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    long_ids = {"model": MODEL_NAME, "prompt": [5] * MAX_MODEL_LEN}
    assert_error(post(server, COMPLETIONS, json=long_ids), 400, "context_length_exceeded", "prompt")


def test_openai_client_raises_bad_request(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=1)
    assert caught.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="hi")


def test_body_too_large(server: RunningServer, limited_server: RunningServer) -> None:
    huge = chat_body(messages=[{"role": "user", "content": "x" * (4 * 1024 * 1024)}])
    assert_error(post(server, CHAT, json=huge), 413, "request_too_large")
    big = chat_body(messages=[{"role": "user", "content": "x" * 70_000}])
    assert_error(post(limited_server, CHAT, json=big), 413, "request_too_large")

    def chunked() -> Any:  # no Content-Length: the limit applies while reading
        yield json.dumps(big).encode()

    assert_error(post(limited_server, CHAT, content=chunked()), 413, "request_too_large")


def test_unknown_route_and_method(server: RunningServer) -> None:
    assert_error(httpx.get(server.base_url + "/v1/nothing"), 404, "not_found")
    assert_error(httpx.get(server.base_url + CHAT), 405, "method_not_allowed")


def test_overload_is_429_with_retry_after(
    limited_server: RunningServer, scripted: Any, slow_steps: SlowDown
) -> None:
    slow_steps(limited_server)
    long_stream = chat_body(max_tokens=400, stream=True, ignore_eos=True)
    with httpx.stream("POST", limited_server.base_url + CHAT, json=long_stream) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # keep it: dropping a half-read iterator closes the response
        next(lines)  # the request is in flight now, for seconds
        refused = post(limited_server, CHAT, json=chat_body())
        assert_error(refused, 429, "rate_limit_exceeded")
        assert refused.headers["retry-after"] == "1"
    limited_server.wait_idle()
    assert post(limited_server, CHAT, json=chat_body()).status_code == 200


def test_draining_refuses_with_503(limited_server: RunningServer, scripted: Any) -> None:
    start_draining(limited_server.app)
    assert_error(post(limited_server, CHAT, json=chat_body()), 503, "server_shutting_down")
    health = httpx.get(limited_server.base_url + "/health")
    assert_error(health, 503, "server_shutting_down")


def test_engine_shutting_down_is_503(limited_server: RunningServer, scripted: Any) -> None:
    scripted.refuse_with = EngineShuttingDown("stopping")
    assert_error(post(limited_server, CHAT, json=chat_body()), 503, "server_shutting_down")


def test_engine_failure_is_500(limited_server: RunningServer, scripted: ScriptedClient) -> None:
    scripted.fail_after = 2
    body = chat_body(max_tokens=10, ignore_eos=True)
    error = assert_error(post(limited_server, CHAT, json=body), 500, "kv_integrity_violation")
    assert error["type"] == "server_error"
    failed_first = {"model": MODEL_NAME, "prompt": "hi"}
    scripted.fail_after = 0
    assert_error(
        post(limited_server, COMPLETIONS, json=failed_first), 500, "kv_integrity_violation"
    )


def test_engine_failure_mid_stream(limited_server: RunningServer, scripted: ScriptedClient) -> None:
    scripted.fail_after = 3
    body = chat_body(max_tokens=10, ignore_eos=True, stream=True)
    with httpx.stream("POST", limited_server.base_url + CHAT, json=body) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    payloads = [json.loads(line.removeprefix("data: ")) for line in events]
    assert "choices" in payloads[0]
    assert payloads[-1]["error"]["code"] == "kv_integrity_violation"
    assert "data: [DONE]" not in events
    with pytest.raises(openai.APIError, match="page 3 was reallocated"):
        stream = limited_server.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        list(stream)
