"""Requests whose client goes away, the process's graceful shutdown, and the real model."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from densa.engine.async_engine import AsyncEngine

from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer, SlowDown, make_engine, running_server

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
LONG = 400  # output tokens: seconds of work once the engine is slowed down


def long_chat(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }


def test_disconnect_mid_stream_frees_pages(server: RunningServer, slow_steps: SlowDown) -> None:
    slow_steps(server)
    kv = server.engine.kv_manager
    steps_before = server.async_engine.num_steps
    with httpx.stream("POST", server.base_url + CHAT, json=long_chat(stream=True)) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in received)
        assert kv.num_free_pages < kv.num_pages  # the request holds pages right now
    server.wait_idle(timeout=2.0)
    # Aborted: far fewer steps than the LONG tokens it asked for.
    assert server.async_engine.num_steps - steps_before < LONG // 2


def test_disconnect_while_waiting_for_a_whole_response(
    server: RunningServer, slow_steps: SlowDown
) -> None:
    slow_steps(server)
    steps_before = server.async_engine.num_steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + CHAT, json=long_chat(stream=False), timeout=httpx.Timeout(5, read=0.3)
        )
    server.wait_idle(timeout=2.0)
    assert server.async_engine.num_steps - steps_before < LONG // 2


def test_server_still_serves_after_disconnects(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3}
    assert httpx.post(server.base_url + CHAT, json=body, timeout=30).status_code == 200


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(base_url: str, process: subprocess.Popen[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


def test_run_server_drains_on_sigterm(tiny_model_dir: Path) -> None:
    """SIGTERM: the running stream completes, new requests are refused, and the process exits 0."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    engine_args = (
        f"EngineArgs(model={str(tiny_model_dir)!r}, served_model_name={MODEL_NAME!r}, "
        f"kv_cache_memory='64MiB', max_model_len={MAX_MODEL_LEN})"
    )
    script = (
        "from densa.engine.args import EngineArgs\n"
        "from densa.serve import run_server\n"
        f"run_server({engine_args}, port={port}, drain_timeout=20, log_level='info')\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_healthy(base_url, process)
        with httpx.stream("POST", base_url + CHAT, json=long_chat(stream=True)) as response:
            lines = response.iter_lines()
            next(lines)
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last_chunk = json.loads(rest[-2].removeprefix("data: "))
        assert last_chunk["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.TransportError):  # the listening socket is closed
            httpx.get(base_url + "/health", timeout=2)
        log, _ = process.communicate(timeout=30)
        assert process.returncode == 0, log
        assert "refusing new requests" in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2_dir: Path) -> None:
    with running_server(AsyncEngine(make_engine(smollm2_dir))) as real:
        response = real.client().chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=30,
        )
    assert "Paris" in (response.choices[0].message.content or "")
