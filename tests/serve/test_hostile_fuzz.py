"""Hostile input in every field, while other clients stream: nobody else notices.

Every string and number field of both generation endpoints (nested ones too) gets each hostile
value in turn: a lone UTF-16 surrogate, null, denormal and huge floats, integers beyond 64 bits,
infinity, and a 200 KB string. Meanwhile victim clients stream greedy requests over and over.
Each hostile request must get a 200 or an OpenAI-style 4xx (never a 5xx), and every victim
output must equal its reference, token for token.

Token ids the model does not have, of every width a client's integers come in (16, 32 and 64 bits,
signed and unsigned, so they pass every size check on the way) and negative ones, anywhere in a
token-id prompt or in stop_token_ids, must get exactly the front's answer: a 400 `invalid_value`
naming the field. (The engine refuses them too, as `invalid_request` without a field: that answer
means the front let them through.)
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from densa.openai.protocol import ChatCompletionRequest, CompletionRequest

from .support import MODEL_NAME, RunningServer, engine_client, running_server

MAX_LEN = 64
HOSTILE_WORKERS = 4  # hostile requests in flight at once, beside the victims
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


def out_of_vocabulary_ids(vocab: int, seed: int = 0) -> list[int]:
    """Ids >= vocab or < 0 that fit in 64 bits: the edges of each width, and random ones."""
    rng = random.Random(seed)
    edges = [vocab, vocab + 1, 2 * vocab, 2**15, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
             2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
             -1, -2, -vocab, -(2**15), -(2**31), -(2**31) - 1, -(2**32), -(2**63)]  # fmt: skip
    drawn = [rng.randrange(vocab, max(2**bits, vocab + 1)) for bits in (16, 32, 32, 64, 64, 64)]
    drawn += [-rng.randrange(1, 2**bits) for bits in (16, 32, 63)]
    return [t for t in edges + drawn if not 0 <= t < vocab]


def token_id_cases(vocab: int) -> list[tuple[str, str, str]]:
    """(path, body, the param the 400 must name): an out-of-vocabulary id first, last, alone or
    among valid ones in a token-id prompt (flat or nested), or in stop_token_ids."""
    rng = random.Random(1)
    out = []
    for bad in out_of_vocabulary_ids(vocab):
        valid = [rng.randrange(256, vocab) for _ in range(4)]
        prompts = [[bad], [bad, *valid], [*valid, bad], [[*valid[:2], bad, *valid[2:]]]]
        for prompt in prompts:
            out.append(("/v1/completions", {**base_completion(), "prompt": prompt}, "prompt"))
        if 0 <= bad <= 2**31 - 1:  # larger or negative stop ids are refused by the schema
            body = {**base_completion(), "stop_token_ids": [valid[0], bad]}
            out.append(("/v1/completions", body, "stop_token_ids"))
    return [(path, json.dumps(body), param) for path, body, param in out]


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

    # One client for every hostile request (its pool keeps a connection per worker): making a
    # client per request cost more than the server's answer (an SSL context each, ~1300 times).
    hostile_client = httpx.Client(limits=httpx.Limits(max_connections=HOSTILE_WORKERS))

    def hostile(case: tuple[str, str]) -> tuple[str, int, dict[str, Any] | None]:
        path, text = case[:2]
        headers = {"content-type": "application/json"}
        response = hostile_client.post(
            base + path, content=text.encode(), headers=headers, timeout=60
        )
        error = None if response.status_code == 200 else response.json()["error"]
        return text[:160], response.status_code, error

    id_cases = token_id_cases(fuzz_server.app.state.densa.served.vocab_size)
    workers = len(VICTIMS) + HOSTILE_WORKERS
    with hostile_client, concurrent.futures.ThreadPoolExecutor(workers) as pool:
        victims = [pool.submit(victim, i) for i in range(len(VICTIMS))]
        results = list(pool.map(hostile, cases()))
        id_results = list(pool.map(hostile, id_cases))
        stop.set()
        for future in victims:
            future.result()
    for (_, _, param), (text, status, error) in zip(id_cases, id_results, strict=True):
        assert status == 400, (text, status, error)
        assert error is not None and error["type"] == "invalid_request_error", (text, error)
        assert (error["code"], error["param"]) == ("invalid_value", param), (text, error)
        assert "out of range" in error["message"], (text, error)
    for text, status, error in results:
        assert status < 500, (text, status, error)
        if error is not None:
            assert error["code"] and error["message"], (text, error)
    assert {status for _, status, _ in results} >= {200, 400}
    assert not mismatches, mismatches[:3]
    assert min(rounds) >= 1
    fuzz_server.wait_idle(timeout=10)
