"""Speculation through the OpenAI API: the engine option, the `speculative` request field, and
the counters in /metrics. A real server over its own engine core process (tiny model)."""

from __future__ import annotations

from pathlib import Path

import httpx

from densa.openai.anthropic_api.models import MessagesRequest
from densa.openai.anthropic_api.to_chat import to_chat_request as anthropic_to_chat
from densa.openai.prepare import parse
from densa.openai.responses_api.models import ResponsesRequest
from densa.openai.responses_api.to_chat import to_chat_request as responses_to_chat
from tests.serve.support import MODEL_NAME, engine_client, running_server

PROMPT = "one two three four five six one two three four five six one two three four"


def test_speculation_through_the_api_with_per_request_opt_out(tiny_model_dir: Path) -> None:
    client = engine_client(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3)
    with running_server(client) as server:
        api = server.client()
        body = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
        speculated = api.completions.create(model=MODEL_NAME, prompt=PROMPT, **body)  # type: ignore[call-overload]
        server.wait_idle()
        proposed = server.stats.num_spec_proposed_tokens
        assert proposed > 0
        body["extra_body"] = {"ignore_eos": True, "speculative": False}
        plain = api.completions.create(model=MODEL_NAME, prompt=PROMPT, **body)  # type: ignore[call-overload]
        server.wait_idle()
        assert server.stats.num_spec_proposed_tokens == proposed  # opted out: nothing proposed
        assert speculated.choices[0].text == plain.choices[0].text
        assert speculated.usage is not None and speculated.usage.completion_tokens == 24
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert f"densa_spec_proposed_tokens_total {float(proposed)}" in metrics
        assert "densa_spec_accepted_tokens_total" in metrics
        bad = httpx.post(
            f"{server.base_url}/v1/completions",
            headers={"Authorization": "Bearer test-key"},
            json={"model": MODEL_NAME, "prompt": "x", "speculative": "sometimes"},
        )
        assert bad.status_code == 400 and "speculative" in bad.text


def test_the_opt_out_through_messages_and_responses() -> None:
    messages = parse(
        MessagesRequest,
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
         "speculative": False},
    )  # fmt: skip
    responses = parse(ResponsesRequest, {"model": "m", "input": "hi", "speculative": False})
    for chat in (anthropic_to_chat(messages), responses_to_chat(responses)):
        assert chat.to_sampling_params(5, None).speculative is False
    default = parse(ResponsesRequest, {"model": "m", "input": "hi"})
    assert responses_to_chat(default).to_sampling_params(5, None).speculative is True
