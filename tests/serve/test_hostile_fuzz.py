"""Hostile input in every field, while other clients stream: nobody else notices.

Every string and number field of both generation endpoints (nested ones too) gets each hostile
value in turn: a lone UTF-16 surrogate, null, denormal and huge floats, integers beyond 64 bits,
infinity, and a 200 KB string. Meanwhile victim clients stream greedy requests over and over.
Each hostile request must get a 200 or an OpenAI-style 4xx (never a 5xx), and every victim
output must equal its reference, token for token.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from densa.serve.protocol import ChatCompletionRequest, CompletionRequest

from .support import MODEL_NAME, RunningServer, engine_client, running_server

MAX_LEN = 64
# Raw JSON text, so values json.dumps would refuse (infinity via 1e400) or rewrite get through.
HOSTILE = ['"a\\ud800b"', "null", "1e-45", "-1e-320", "1e308", "-1e308", "1e400", "18446744073709551617",
           "-9223372036854775809", '"' + "x" * 200_000 + '"', "[]", "{}", "true"]  # fmt: skip
NESTED_CHAT = ["messages[0].content", "messages[0].role", "messages[0].name", "stop[0]",
               "stream_options.include_usage", "messages[0].content[0].text"]  # fmt: skip
NESTED_COMPLETIONS = ["prompt[0]", "stop[0]"]


def base_chat() -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stop": ["zz"], "stream_options": {"include_usage": True}}  # fmt: skip


def base_completion() -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": [300, 301, 302], "max_tokens": 2, "stop": ["zz"]}


def with_raw(body: dict[str, Any], path: str, raw: str) -> str:
    """The body as JSON text with `raw` (JSON text) at `path` ("a[0].b")."""
    marker = "__HOSTILE__"
    data = copy.deepcopy(body)
    steps = path.replace("]", "").replace("[", ".").split(".")
    target: Any = data
    for step in steps[:-1]:
        key: Any = int(step) if step.isdigit() else step
        if key == "content" and isinstance(target.get("content"), str):
            target["content"] = [{"type": "text", "text": target["content"]}]
        target = target[key]
    last: Any = int(steps[-1]) if steps[-1].isdigit() else steps[-1]
    target[last] = marker
    return json.dumps(data).replace(f'"{marker}"', raw)


def cases() -> list[tuple[str, str]]:
    out = []
    for path in [*ChatCompletionRequest.model_fields, *NESTED_CHAT]:
        out += [("/v1/chat/completions", with_raw(base_chat(), path, raw)) for raw in HOSTILE]
    for path in [*CompletionRequest.model_fields, *NESTED_COMPLETIONS]:
        out += [("/v1/completions", with_raw(base_completion(), path, raw)) for raw in HOSTILE]
    return out


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    client = engine_client(tiny_model_dir, max_model_len=MAX_LEN, max_num_seqs=8)
    with running_server(client) as running:
        yield running


VICTIMS = [
    {"model": MODEL_NAME, "prompt": [400 + i, 500 + i, 600 + i], "max_tokens": 24,
     "temperature": 0, "ignore_eos": True, "stream": True}
    for i in range(3)
]  # fmt: skip


def stream_tokens(client: httpx.Client, base_url: str, body: dict[str, Any]) -> str:
    text = []
    with client.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"] if chunk["choices"] else "")
    return "".join(text)


def test_hostile_fields_never_cost_other_clients_anything(fuzz_server: RunningServer) -> None:
    base = fuzz_server.base_url
    with httpx.Client() as client:
        references = [stream_tokens(client, base, v) for v in VICTIMS]
    assert all(references)
    stop = threading.Event()
    rounds = [0] * len(VICTIMS)
    mismatches: list[str] = []

    def victim(idx: int) -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                got = stream_tokens(client, base, VICTIMS[idx])
                if got != references[idx]:
                    mismatches.append(f"victim {idx}: {got!r} != {references[idx]!r}")
                rounds[idx] += 1

    def hostile(case: tuple[str, str]) -> tuple[str, int, dict[str, Any] | None]:
        path, text = case
        headers = {"content-type": "application/json"}
        with httpx.Client() as client:
            response = client.post(base + path, content=text.encode(), headers=headers, timeout=60)
        error = None if response.status_code == 200 else response.json()["error"]
        return text[:160], response.status_code, error

    with concurrent.futures.ThreadPoolExecutor(len(VICTIMS) + 4) as pool:
        victims = [pool.submit(victim, i) for i in range(len(VICTIMS))]
        results = list(pool.map(hostile, cases()))
        stop.set()
        for future in victims:
            future.result()
    for text, status, error in results:
        assert status < 500, (text, status, error)
        if error is not None:
            assert error["code"] and error["message"], (text, error)
    assert {status for _, status, _ in results} >= {200, 400}
    assert not mismatches, mismatches[:3]
    assert min(rounds) >= 1
    fuzz_server.wait_idle(timeout=10)
