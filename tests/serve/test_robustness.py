"""Request deadlines, clients that leave, and bad inputs that must be refused without changing
anything else."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from densa.sampling_params import MAX_STOP_STRINGS
from densa.serve.scrape import scrape

from .conftest import SlowDown
from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**overrides: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **overrides,
    }


def post(server: RunningServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=30, **kwargs)


# ---- deadlines ----------------------------------------------------------------------------------
@pytest.fixture
def deadline(server: RunningServer, slow_steps: SlowDown) -> Iterator[float]:
    """The shared server with a 1 s per-request deadline and 10 ms engine steps, for one test: a
    300-token answer needs >= 3 s, a 3-token one well under 1 s even on a loaded machine."""
    slow_steps(server)
    state = server.app.state.densa
    state.request_timeout = 1.0
    yield state.request_timeout
    state.request_timeout = None


def test_a_request_past_its_deadline_is_aborted(server: RunningServer, deadline: float) -> None:
    long = chat_body(max_tokens=300, ignore_eos=True)
    steps_before = server.stats.num_steps
    response = post(server, CHAT, json=long)
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "request_timeout"
    assert f"{deadline:g} s" in error["message"]
    server.wait_idle(timeout=2.0)  # aborted: every page is free again
    assert server.stats.num_steps - steps_before < 150


def test_a_stream_past_its_deadline_ends_with_an_error_event(
    server: RunningServer, deadline: float
) -> None:
    long = chat_body(max_tokens=300, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.base_url + CHAT, json=long, timeout=30) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == "request_timeout"
    assert "data: [DONE]" not in events
    server.wait_idle(timeout=2.0)
    metrics = scrape(server.base_url)
    assert metrics.value("densa_requests_total", status="200", outcome="request_timeout") >= 1
    assert metrics.value("densa_requests_total", status="504", outcome="request_timeout") >= 1


def test_a_deadline_can_pass_before_the_first_token(server: RunningServer) -> None:
    state = server.app.state.densa
    state.request_timeout = 0.001
    try:
        for stream in (False, True):
            response = post(server, CHAT, json=chat_body(max_tokens=50, stream=stream))
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "request_timeout"
    finally:
        state.request_timeout = None
    server.wait_idle(timeout=2.0)


def test_short_requests_finish_within_the_deadline(server: RunningServer, deadline: float) -> None:
    assert post(server, CHAT, json=chat_body(max_tokens=3)).status_code == 200


# ---- clients that leave -------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_request_whose_client_left_is_aborted(
    server: RunningServer, slow_steps: SlowDown, stream: bool
) -> None:
    """With 10 ms steps the 400-token answer needs >= 4 s; the client leaves after 0.5 s (a
    non-streaming one gives up waiting, a streaming one after two events), and the request must
    leave the engine within a few steps, not run to its end for nobody."""
    slow_steps(server)
    server.wait_idle()
    before, engine_before = scrape(server.base_url), server.stats
    long = chat_body(max_tokens=400, ignore_eos=True, stream=stream)
    if stream:
        with httpx.stream("POST", server.base_url + CHAT, json=long, timeout=30) as response:
            assert response.status_code == 200
            events = (line for line in response.iter_lines() if line.startswith("data: {"))
            next(events), next(events)  # then leave: the connection closes mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + CHAT, json=long, timeout=httpx.Timeout(30, read=0.5))
    left = server.stats
    server.wait_idle(timeout=30)  # every page free again
    idle = server.stats
    after_leaving = idle.num_generated_tokens - left.num_generated_tokens
    assert after_leaving < 100, f"{after_leaving} tokens sampled after the client left"
    assert idle.num_generated_tokens - engine_before.num_generated_tokens < 200
    metrics = scrape(server.base_url)
    status = "200" if stream else "499"  # the stream had its status line; the other did not
    closed = {"status": status, "outcome": "client_closed"}
    counted = metrics.value("densa_requests_total", **closed)
    assert counted == before.value("densa_requests_total", **closed) + 1


# ---- bad inputs ---------------------------------------------------------------------------------
BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str]] = [
    # (path, httpx.post keyword arguments, status, error code)
    (CHAT, {"json": chat_body(max_tokens=10**9)}, 400, "context_length_exceeded"),
    (CHAT, {"json": chat_body(max_completion_tokens=MAX_MODEL_LEN)}, 400, "context_length_exceeded"),
    (COMPLETIONS, {"json": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2**80}}, 400,
     "context_length_exceeded"),
    (CHAT, {"json": chat_body(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])}, 400,
     "invalid_value"),
    (CHAT, {"json": chat_body(messages=[{"role": "root", "content": "x"}])}, 400, "invalid_value"),
    (CHAT, {"json": chat_body(messages=[])}, 400, "invalid_value"),
    (CHAT, {"json": chat_body(max_tokens="10")}, 400, "invalid_value"),
    (CHAT, {"content": b"[" * 100_000}, 400, "invalid_json"),
    (CHAT, {"content": b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}'},
     400, "invalid_encoding"),
    (CHAT, {"content": b"{" + b" " * (5 * 1024 * 1024) + b"}"}, 413, "request_too_large"),
    (COMPLETIONS, {"json": {"model": MODEL_NAME, "prompt": [2**40]}}, 400, "invalid_value"),
    (COMPLETIONS, {"json": {"model": MODEL_NAME, "prompt": "x", "stop_token_ids": [10**12]}}, 400,
     "invalid_value"),
]  # fmt: skip


def test_bad_inputs_get_a_clear_4xx_and_change_nothing(server: RunningServer) -> None:
    server.wait_idle()
    engine_before = server.stats
    for path, kwargs, status, code in BAD_REQUESTS:
        response = post(server, path, **kwargs)
        assert response.status_code == status, (kwargs, response.text)
        error = response.json()["error"]
        assert error["code"] == code, (kwargs, error)
        assert error["message"]
    engine_after = server.stats
    # The engine never saw them: no step ran, no page or prefix-cache entry changed.
    assert engine_after == engine_before
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_max_tokens_up_to_the_context_is_accepted(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": [300] * 10, "max_tokens": MAX_MODEL_LEN - 10}
    with httpx.stream("POST", server.base_url + COMPLETIONS, json={**body, "stream": True}) as r:
        assert r.status_code == 200  # admitted; leaving now aborts it
    server.wait_idle()
