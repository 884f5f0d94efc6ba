"""`echo` on /v1/completions: the prompt comes back before the completion, with its tokens'
logprobs in the legacy shape (the first token's null), as lm-evaluation-harness reads them to
score log-likelihoods (`max_tokens: 0` or 1). The logprobs are the model's teacher-forced ones:
equal to densa's offline scoring of the same tokens, whether the prompt was in the prefix cache
or not, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from densa.engine.llm import LLM
from densa.offline.scoring import token_logprobs

from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer

COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog because it"


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> Iterator[LLM]:
    yield LLM(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")


@pytest.fixture(autouse=True)
def idle_after(server: RunningServer) -> Iterator[None]:
    yield
    server.wait_idle()


def _complete(server: RunningServer, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, **fields}
    return httpx.post(server.base_url + COMPLETIONS, json=body, timeout=60)


def _ok(server: RunningServer, **fields: Any) -> dict[str, Any]:
    response = _complete(server, **fields)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_scores_the_prompt_as_offline_scoring_does(
    server: RunningServer, offline: LLM
) -> None:
    body = _ok(server, echo=True, logprobs=2, max_tokens=0)
    choice = body["choices"][0]
    prompt_ids = server.tokenizer.encode(PROMPT)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [server.tokenizer.decode([t], False) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    want = token_logprobs(offline.engine, prompt_ids).tolist()
    assert logprobs["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    for top, chosen in zip(
        logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:], strict=True
    ):
        assert len(top) <= 2 and max(top.values()) >= chosen - 1e-6  # the 2 most likely
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert "".join(logprobs["tokens"]) == PROMPT
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 0


def test_echo_with_a_completion_lists_prompt_then_generated_tokens(server: RunningServer) -> None:
    plain = _ok(server, logprobs=1, max_tokens=4)["choices"][0]
    echoed = _ok(server, echo=True, logprobs=1, max_tokens=4)["choices"][0]
    num_prompt = len(server.tokenizer.encode(PROMPT))
    assert echoed["text"] == PROMPT + plain["text"]
    logprobs = echoed["logprobs"]
    assert len(logprobs["tokens"]) == num_prompt + 4
    assert logprobs["tokens"][num_prompt:] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][num_prompt:] == plain["logprobs"]["token_logprobs"]
    # Offsets count from the start of the returned text, the prompt's included.
    assert logprobs["text_offset"][num_prompt] == len(PROMPT)


def test_an_end_token_generated_after_the_echo_keeps_its_logprobs_entry(
    server: RunningServer,
) -> None:
    """lm-evaluation-harness sends echo, logprobs 1, max_tokens 1 and reads the last entry as the
    generated token: when that token ends the answer (here a stop_token_ids entry, EOS alike) it
    must still be listed, or the harness cuts the prompt's last token instead."""
    num_prompt = len(server.tokenizer.encode(PROMPT))
    free = _ok(server, echo=True, logprobs=1, max_tokens=1)["choices"][0]
    [next_id] = server.tokenizer.encode(free["logprobs"]["tokens"][-1], add_special_tokens=False)
    ended = _ok(server, echo=True, logprobs=1, max_tokens=1, ignore_eos=True,
                stop_token_ids=[next_id])["choices"][0]  # fmt: skip
    assert ended["finish_reason"] == "stop" and ended["text"] == PROMPT
    assert len(ended["logprobs"]["token_logprobs"]) == num_prompt + 1
    assert ended["logprobs"]["token_logprobs"] == free["logprobs"]["token_logprobs"]


def test_a_cached_prompt_is_scored_the_same(server: RunningServer) -> None:
    prompt = PROMPT + " was tired of the fox and of all its jumping around the yard all day long"
    first = _ok(server, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    _ok(server, prompt=prompt, max_tokens=1)  # cached now
    cached = _ok(server, prompt=prompt, max_tokens=1)
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    again = _ok(server, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed again
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


def test_streamed_echo_sends_the_prompt_first(server: RunningServer) -> None:
    whole = _ok(server, echo=True, logprobs=1, max_tokens=3)["choices"][0]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "echo": True,
            "logprobs": 1, "max_tokens": 3, "stream": True}  # fmt: skip
    url = server.base_url + COMPLETIONS
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"] == PROMPT
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]


def test_echo_of_token_ids_and_without_logprobs(server: RunningServer) -> None:
    prompt_ids = server.tokenizer.encode(PROMPT)
    body = _ok(server, prompt=prompt_ids, echo=True, max_tokens=2)
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT) and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 2


def test_every_choice_echoes(server: RunningServer) -> None:
    body = _ok(server, echo=True, logprobs=0, max_tokens=0, n=2)
    first, second = body["choices"]
    assert first["text"] == second["text"] == PROMPT
    assert first["logprobs"] == second["logprobs"]
    assert body["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, None),  # nothing to generate and nothing to echo
        ({"echo": True, "suffix": "x"}, None),
        ({"suffix": "x"}, "suffix"),  # the tiny model has no FIM tokens
    ],
)
def test_refused(server: RunningServer, fields: dict[str, Any], param: str | None) -> None:
    response = _complete(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param and error["code"] == "unsupported_value"
        assert "fill in the middle" in error["message"]
