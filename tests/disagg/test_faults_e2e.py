"""Faults between real workers (each engine core its own process, killed for real): after each,
the client got an explicit error or a complete correct answer, never a hang; once idle every
page on both sides is free and no integrity check fired."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.support import MODEL_NAME, RunningServer

from .conftest import TIMEOUT_S, placed

COMPLETIONS = "/v1/completions"
PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 4


@pytest.fixture
def pf(prefill: RunningServer) -> RunningServer:
    return prefill  # the session's workers (conftest.py); these tests restart their engines


@pytest.fixture
def dc(decode: RunningServer) -> RunningServer:
    return decode


@pytest.fixture(autouse=True)
def healthy(pf: RunningServer, dc: RunningServer) -> Iterator[None]:
    """Each test starts with both engines up and normal speed, and ends with everything free."""
    for server in (pf, dc):
        wait_for(lambda s=server: _health(s) == 200, 60, "the engine is up")
        server.set_step_delay(0.0)
    yield
    for server in (pf, dc):
        wait_for(lambda s=server: _health(s) == 200, 60, "the engine came back")
        server.set_step_delay(0.0)
    assert_all_free(pf, dc)


def _health(server: RunningServer) -> int:
    return httpx.get(server.base_url + "/health", timeout=5).status_code


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def assert_all_free(*servers: RunningServer) -> None:
    for server in servers:
        server.wait_idle(timeout=4 * TIMEOUT_S)
        stats = server.stats
        assert sum(stats.integrity_violations.values()) == 0
        assert stats.disagg.get("held_pages", 0) == 0


def engine_pid(server: RunningServer) -> int:
    return int(httpx.get(server.base_url + "/health", timeout=5).json()["engine_pid"])


def body(stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}  # fmt: skip


def post(dc: RunningServer, pf: RunningServer, **kwargs: Any) -> httpx.Response:
    return httpx.post(
        dc.base_url + COMPLETIONS, json=body(**kwargs), headers=placed(pf.base_url),
        timeout=30,
    )  # fmt: skip


def in_background(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", call()))
    thread.start()
    return thread, result


def test_a_handoff_works_then_its_answer_is_correct(pf: RunningServer, dc: RunningServer) -> None:
    local = httpx.post(dc.base_url + COMPLETIONS, json=body(), timeout=30).json()
    split = post(dc, pf).json()
    assert split["choices"][0]["text"] == local["choices"][0]["text"]


def test_kill_9_of_prefill_mid_transfer_is_an_error_then_decode_frees_its_pages(
    pf: RunningServer, dc: RunningServer
) -> None:
    pf.set_step_delay(2.0)  # the prompt is surely computing when the kill lands
    thread, result = in_background(lambda: post(dc, pf))
    wait_for(lambda: dc.stats.disagg.get("in_requested", 0) == 1, 10, "decode asked")
    os.kill(engine_pid(pf), signal.SIGKILL)
    started = time.monotonic()
    thread.join(4 * TIMEOUT_S)
    response = result["value"]
    assert time.monotonic() - started < 3 * TIMEOUT_S  # the transfer timeout, not a hang
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "kv_transfer_timeout"


def test_kill_9_of_decode_mid_transfer_frees_the_prefill_pages_on_its_timer(
    pf: RunningServer, dc: RunningServer
) -> None:
    pf.set_step_delay(1.0)
    thread, result = in_background(lambda: post(dc, pf))
    wait_for(lambda: pf.stats.disagg.get("in_computing", 0) == 1, 10, "prefill computing")
    os.kill(engine_pid(dc), signal.SIGKILL)
    thread.join(10)
    response = result["value"]
    assert response.status_code == 503  # explicit: the decode engine is gone
    assert response.json()["error"]["code"] == "engine_unavailable"
    # Prefill shipped the pages to nobody; without an ack its timer frees them.
    wait_for(lambda: pf.stats.disagg.get("ack_timeouts", 0) >= 1, 4 * TIMEOUT_S, "ack timeout")


def _stream(dc: RunningServer, pf: RunningServer, started: threading.Event) -> dict[str, Any]:
    with httpx.stream(
        "POST", dc.base_url + COMPLETIONS, json=body(stream=True, max_tokens=200),
        headers=placed(pf.base_url), timeout=30,
    ) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                started.set()
                if "error" in chunk:
                    return dict(chunk["error"])
    return {}


def test_kill_9_of_decode_mid_stream_ends_the_stream_with_an_error(
    pf: RunningServer, dc: RunningServer
) -> None:
    dc.set_step_delay(0.05)
    started = threading.Event()
    thread, result = in_background(lambda: _stream(dc, pf, started))
    assert started.wait(20)
    os.kill(engine_pid(dc), signal.SIGKILL)
    thread.join(10)
    assert result["value"]["code"] == "engine_unavailable"


def _request_then_hang_up(dc: RunningServer, pf: RunningServer, when: Any) -> None:
    """Send a streaming request on a raw socket and close the connection once `when()` holds
    (an HTTP client would wait for the response headers, which come with the first token)."""
    host, port = dc.base_url.removeprefix("http://").split(":")
    payload = json.dumps(body(stream=True, max_tokens=200)).encode()
    placement = "".join(f"{name}: {value}\r\n" for name, value in placed(pf.base_url).items())
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"{placement}Content-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head.encode() + payload)
        wait_for(when, 10, "the request reached the phase")


def test_client_disconnect_during_prefill_frees_both_sides(
    pf: RunningServer, dc: RunningServer
) -> None:
    pf.set_step_delay(1.0)
    _request_then_hang_up(dc, pf, lambda: pf.stats.disagg.get("in_computing", 0) == 1)
    wait_for(lambda: dc.stats.disagg.get("transfers_aborted", 0) >= 1, 10, "decode aborted")
    wait_for(lambda: pf.stats.disagg.get("transfers_aborted", 0) >= 1, 10, "prefill stopped")


def test_client_disconnect_during_transfer_frees_both_sides(
    pf: RunningServer, dc: RunningServer
) -> None:
    """Hang up the moment decode holds its destination pages (the prompt is computing or the
    pages are on their way): decode keeps them until prefill has stopped, then frees them."""
    pf.set_step_delay(1.0)  # the pages are requested for at least a second
    _request_then_hang_up(dc, pf, lambda: dc.stats.disagg.get("in_requested", 0) == 1)
    wait_for(lambda: dc.engine.num_in_flight == 0, 10, "the decode request ended")


def test_client_disconnect_during_decode_frees_both_sides(
    pf: RunningServer, dc: RunningServer
) -> None:
    dc.set_step_delay(0.05)
    landed = dc.stats.disagg.get("transfers_landed", 0)
    _request_then_hang_up(dc, pf, lambda: dc.stats.disagg.get("transfers_landed", 0) > landed)
    wait_for(lambda: dc.engine.num_in_flight == 0, 10, "the decode request ended")
