"""OpenAI compatibility on the edges, and hostile input refused before it costs anything.

Nulls mean "the default"; unimplemented parameters (and, with --strict-api, unknown ones) are
400s naming them; a final assistant message is continued; text no UTF-8 encoder can write is a
400 naming its field; text too long for the context is refused before it is tokenized; a client
that leaves mid-body is a 499-class outcome, not a server error.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from densa.serve.scrape import scrape

from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    body.update(overrides)
    return body


def post(server: RunningServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=30, **kwargs)


def post_raw(server: RunningServer, path: str, text: str) -> httpx.Response:
    """Send JSON text as is: json.dumps escapes a lone surrogate as \\ud800, valid JSON."""
    headers = {"content-type": "application/json"}
    return post(server, path, content=text.encode("ascii"), headers=headers)


@pytest.fixture(autouse=True)
def still_serving(server: RunningServer) -> Any:
    yield
    assert httpx.get(server.base_url + "/health").status_code == 200
    server.wait_idle()


# ---- nulls --------------------------------------------------------------------------------------
NULLABLE_CHAT = ["stream", "logprobs", "top_logprobs", "stream_options", "n", "stop", "seed",
                 "temperature", "top_p", "user", "max_tokens", "presence_penalty", "tools",
                 "tool_choice", "response_format", "store", "metadata", "ignore_eos",
                 "min_tokens", "stop_token_ids", "skip_special_tokens", "cache_salt"]  # fmt: skip
NULLABLE_COMPLETIONS = ["stream", "logprobs", "echo", "suffix", "best_of", "n", "stop", "seed",
                        "max_tokens", "user"]  # fmt: skip


def test_null_means_the_default_for_every_optional_field(server: RunningServer) -> None:
    body = chat_body(**dict.fromkeys(NULLABLE_CHAT))
    body["max_tokens"] = 2  # null would mean "up to the context": keep the test short
    response = post(server, CHAT, json=body)
    assert response.status_code == 200, response.text
    completion = {"model": MODEL_NAME, "prompt": "hi", **dict.fromkeys(NULLABLE_COMPLETIONS)}
    response = post(server, COMPLETIONS, json=completion)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens


def test_null_in_a_required_field_is_refused(server: RunningServer) -> None:
    for body, param in ((chat_body(messages=None), "messages"), (chat_body(model=None), "model")):
        response = post(server, CHAT, json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param


# ---- parameters densa does not implement --------------------------------------------------------
UNSUPPORTED = [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("store", True),
    ("metadata", {"k": "v"}),
    ("service_tier", "flex"),
    ("web_search_options", {}),
]


@pytest.mark.parametrize(("param", "value"), UNSUPPORTED)
def test_unimplemented_parameters_are_refused_by_name(
    server: RunningServer, param: str, value: Any
) -> None:
    response = post(server, CHAT, json=chat_body(**{param: value}))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter"
    assert error["param"] == param
    assert param in error["message"]


def test_values_that_ask_for_nothing_pass(server: RunningServer) -> None:
    body = chat_body(
        store=False, tool_choice="none", modalities=["text"], service_tier="auto",
        response_format={"type": "text"}, stream_options={"include_usage": True}, stream=True,
    )  # fmt: skip
    with httpx.stream("POST", server.base_url + CHAT, json=body, timeout=30) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_strict_api_refuses_unknown_fields_by_name(
    server: RunningServer, api_options: Any, path: str
) -> None:
    api_options(strict_api=True)  # `densa serve --strict-api`; test_compat.py: the default
    body = chat_body(temprature=0.5) if path == CHAT else {"model": MODEL_NAME, "prompt": "x",
                                                           "max_token": 3}  # fmt: skip
    response = post(server, path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unknown_parameter"
    assert error["param"] in ("temprature", "max_token")
    assert "unrecognized" in error["message"]


def test_prompt_cache_key_acts_as_the_session(server: RunningServer) -> None:
    body = chat_body(prompt_cache_key="conversation-7", safety_identifier="end-user-3")
    assert post(server, CHAT, json=body).status_code == 200
    server.wait_idle()
    metrics = scrape(server.base_url)
    assert metrics.value("densa_session_requests_total") >= 1


# ---- a final assistant message is continued -----------------------------------------------------
def test_a_final_assistant_message_is_continued_not_answered(server: RunningServer) -> None:
    tokenizer = server.tokenizer
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant",
                "content": "My favourite color is"}]  # fmt: skip
    prompt = tokenizer.decode(tokenizer.encode_chat(messages, None, True), False)
    assert prompt.endswith("My favourite color is")  # no end-of-turn, no new assistant turn
    assert prompt.count("<|im_start|>assistant") == 1
    response = post(server, CHAT, json=chat_body(messages=messages, max_tokens=3))
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, False))


# ---- text that is not text ----------------------------------------------------------------------
def _with_surrogate(body: dict[str, Any], path: list[Any]) -> str:
    """The body as JSON text with a lone surrogate at `path` (a key if the last step is None)."""
    target = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = "a\ud800b"
    return json.dumps(body)


SURROGATE_FIELDS = [
    (CHAT, ["messages", 0, "content"], "messages[0].content"),
    (CHAT, ["user"], "user"),
    (CHAT, ["cache_salt"], "cache_salt"),
    (CHAT, ["stop"], "stop"),
    (CHAT, ["messages", 0, "name"], "messages[0].name"),
    (CHAT, ["model"], "model"),
    (COMPLETIONS, ["prompt"], "prompt"),
]


@pytest.mark.parametrize(("path", "field", "param"), SURROGATE_FIELDS)
def test_lone_surrogates_are_refused_naming_the_field(
    server: RunningServer, path: str, field: list[Any], param: str
) -> None:
    body = chat_body() if path == CHAT else {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    response = post_raw(server, path, _with_surrogate(body, field))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_encoding", param)


def test_a_surrogate_in_a_key_is_refused(server: RunningServer) -> None:
    text = json.dumps(chat_body()).replace('"user"', '"us\\ud800er"', 1)
    text = text[:-1] + ', "x\\udfff": 1}'
    response = post_raw(server, CHAT, text)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_encoding"


# ---- token ids the model does not have ----------------------------------------------------------
def _vocab(server: RunningServer) -> int:
    vocab = server.app.state.densa.served.vocab_size
    assert isinstance(vocab, int)
    return vocab


# In 32 or 64 bits (so nothing on the way overflows): only the vocabulary check can refuse them.
OUT_OF_VOCABULARY: list[int | str] = ["vocab", "vocab+1", 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1,
                                      -1, -(2**31), -(2**63)]  # fmt: skip


@pytest.mark.parametrize("bad_id", OUT_OF_VOCABULARY)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_out_of_vocabulary_token_ids_are_refused_naming_the_prompt(
    server: RunningServer, bad_id: int | str, stream: bool
) -> None:
    vocab = _vocab(server)
    bad = {"vocab": vocab, "vocab+1": vocab + 1}.get(bad_id, bad_id)
    server.wait_idle()
    engine_before = server.stats
    for prompt in ([bad], [300, 301, bad, 302], [[300, bad]]):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "stream": stream}
        response = post(server, COMPLETIONS, json=body)
        assert response.status_code == 400, (prompt, response.text)
        error = response.json()["error"]
        got = (error["type"], error["code"], error["param"])
        assert got == ("invalid_request_error", "invalid_value", "prompt"), (prompt, error)
        assert f"token ids out of range [0, {vocab}): [{bad}]" in error["message"], error
    # Refused in front: the engine never saw them.
    assert server.stats == engine_before
    # The last id in the vocabulary is fine.
    body = {"model": MODEL_NAME, "prompt": [300, vocab - 1], "max_tokens": 1}
    assert post(server, COMPLETIONS, json=body).status_code == 200


def test_out_of_vocabulary_stop_token_ids_are_refused_by_name(server: RunningServer) -> None:
    vocab = _vocab(server)
    for bad in (vocab, 2**31 - 1):
        body = {"model": MODEL_NAME, "prompt": [300], "max_tokens": 2, "stop_token_ids": [5, bad]}
        response = post(server, COMPLETIONS, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "stop_token_ids"), error


# ---- too long to fit is refused before tokenizing -----------------------------------------------
def test_text_too_long_for_the_context_is_refused_before_tokenizing(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = server.tokenizer
    calls: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(
        tokenizer, "encode", lambda text, *a: calls.append(len(text)) or encode(text, *a)
    )
    huge = "x" * (2 * MAX_MODEL_LEN * tokenizer.max_token_bytes + 1)
    for path, body in (
        (CHAT, chat_body(messages=[{"role": "user", "content": huge}])),
        (COMPLETIONS, {"model": MODEL_NAME, "prompt": huge, "max_tokens": 1}),
        (CHAT, chat_body(messages=[{"role": "user", "content": "x"}] * (MAX_MODEL_LEN + 1))),
    ):
        response = post(server, path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []  # the tokenizer never saw them


# ---- clients that go away or stall --------------------------------------------------------------
def _open(server: RunningServer) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_client_gone_mid_body_is_a_499_not_a_500(server: RunningServer) -> None:
    before = scrape(server.base_url)
    with _open(server) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + b'{"model": "tiny", "mess'
        )
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = scrape(server.base_url)
        closed = after.value("densa_requests_total", status="499", outcome="client_closed")
        if closed > before.value("densa_requests_total", status="499", outcome="client_closed"):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the abandoned request was not counted as status 499")
    assert after.value("densa_requests_total", status="500", outcome="internal_error") == (
        before.value("densa_requests_total", status="500", outcome="internal_error")
    )


def _read_response(sock: socket.socket) -> str:
    """Headers and the whole body (they may arrive in several reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(4096)
    return (head + b"\r\n\r\n" + body).decode()


def test_a_body_that_never_arrives_times_out(server: RunningServer) -> None:
    state = server.app.state.densa
    state.body_timeout = 0.3
    try:
        with _open(server) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n{"
            )
            reply = _read_response(sock)
    finally:
        state.body_timeout = 30.0
    assert reply.startswith("HTTP/1.1 408")
    assert "request_body_timeout" in reply
