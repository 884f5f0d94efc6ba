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

from densa.serve import build_app, serve_in_thread

from .conftest import SlowDown
from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer, engine_client, running_server

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
    steps_before = server.stats.num_steps
    with httpx.stream("POST", server.base_url + CHAT, json=long_chat(stream=True)) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in received)
        stats = server.stats
        assert stats.num_free_kv_pages < stats.num_kv_pages  # the request holds pages now
    server.wait_idle(timeout=2.0)
    # Aborted: far fewer steps than the LONG tokens it asked for.
    assert server.stats.num_steps - steps_before < LONG // 2


def test_disconnect_while_waiting_for_a_whole_response(
    server: RunningServer, slow_steps: SlowDown
) -> None:
    slow_steps(server)
    steps_before = server.stats.num_steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + CHAT, json=long_chat(stream=False), timeout=httpx.Timeout(5, read=0.3)
        )
    server.wait_idle(timeout=2.0)
    assert server.stats.num_steps - steps_before < LONG // 2


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


def start_server(model_dir: Path, port: int, slow: bool = True) -> subprocess.Popen[str]:
    """`run_server` in a subprocess, its engine steps slowed to >= 10 ms (so a long stream lasts
    seconds)."""
    engine_args = (
        f"EngineArgs(model={str(model_dir)!r}, served_model_name={MODEL_NAME!r}, "
        f"kv_cache_memory='64MiB', max_model_len={MAX_MODEL_LEN})"
    )
    script = (
        "import time\n"
        "from densa.setup.args import EngineArgs\n"
        "from densa.engine.llm_engine import LLMEngine\n"
        "from densa.serve import run_server\n"
        "step = LLMEngine.step\n"
        f"LLMEngine.step = lambda self: (time.sleep({0.01 if slow else 0}), step(self))[1]\n"
        f"run_server({engine_args}, port={port}, drain_timeout=20, log_level='info')\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_run_server_drains_on_sigterm(tiny_model_dir: Path) -> None:
    """SIGTERM: the running stream completes, new requests get 503 meanwhile (the port keeps
    answering, so a load balancer retries elsewhere), then the process exits 0."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = start_server(tiny_model_dir, port)
    try:
        wait_healthy(base_url, process)
        with httpx.stream("POST", base_url + CHAT, json=long_chat(stream=True)) as response:
            lines = response.iter_lines()
            next(lines)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # the signal is handled between two engine steps
            assert httpx.get(base_url + "/health", timeout=5).status_code == 503
            refused = httpx.post(base_url + CHAT, json=long_chat(stream=False), timeout=5)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "server_shutting_down"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last_chunk = json.loads(rest[-2].removeprefix("data: "))
        assert last_chunk["choices"][0]["finish_reason"] == "length"
        log, _ = process.communicate(timeout=30)
        assert process.returncode == 0, log
        assert "refusing new requests" in log
        with pytest.raises(httpx.TransportError):  # drained: the process is gone
            httpx.get(base_url + "/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_slow_headers_get_408_and_the_connection_closed(tiny_model_dir: Path) -> None:
    """A client that opens a connection and sends its headers too slowly is cut off, and the
    server goes on serving others."""
    app = build_app(engine_client(tiny_model_dir))  # its lifespan starts and stops the engine
    with serve_in_thread(app, header_timeout=0.3) as base_url:
        host, port = base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=15) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # never ends
            started = time.monotonic()
            reply = sock.recv(4096)
            waited = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"request_header_timeout" in reply
        assert waited < 14  # closed by the server, not by this socket's own timeout
        with socket.create_connection((host, int(port)), timeout=15) as idle:
            assert idle.recv(4096).startswith(b"HTTP/1.1 408")  # silent after connecting
        assert httpx.get(base_url + "/health", timeout=5).status_code == 200


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2_dir: Path) -> None:
    with running_server(engine_client(smollm2_dir)) as real:
        response = real.client().chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=30,
        )
    assert "Paris" in (response.choices[0].message.content or "")
