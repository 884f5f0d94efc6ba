"""`densa router --prefill URL --decode URL` over real prefill and decode workers: the router
pairs them (the decode worker answers, the prefill worker is named in x-densa-prefill), greedy
tokens are those of one co-located server, streaming passes through, a repeated prompt counts
cached tokens, and afterwards every page is free on both sides."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from densa.router.app import build_router_app
from densa.router.config import RouterConfig
from densa.serve.process import serve_in_thread
from tests.serve.support import MODEL_NAME, RunningServer

from .conftest import SECRET
from .test_serving import PROMPTS, assert_all_free, complete


@pytest.fixture
def routed(prefill: RunningServer, decode: RunningServer) -> Iterator[openai.OpenAI]:
    config = RouterConfig(prefill=(prefill.base_url,), decode=(decode.base_url,), secret=SECRET,
                          debug_headers=True)  # fmt: skip
    app = build_router_app(config)
    with serve_in_thread(app) as base:
        router = app.state.router.router
        deadline = time.monotonic() + 30
        while router.model is None or len(router.pool.healthy()) < 2:
            assert time.monotonic() < deadline, "the router did not admit both pools"
            time.sleep(0.05)
        yield openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=60)


def _create(api: openai.OpenAI, prompt: str, **body: Any) -> Any:
    return api.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.0, **body
    )  # type: ignore[call-overload]


def test_the_router_pairs_the_pools_and_tokens_match_one_server(
    routed: openai.OpenAI, reference: RunningServer, prefill: RunningServer,
    decode: RunningServer,
) -> None:  # fmt: skip
    for prompt in PROMPTS[:4]:
        raw = _create(routed, prompt)
        assert raw.headers["x-densa-worker"] == decode.base_url
        assert raw.headers["x-densa-prefill"] == prefill.base_url
        assert raw.parse().choices[0].text == complete(reference, prompt).choices[0].text
    stream = routed.completions.create(model=MODEL_NAME, prompt=PROMPTS[5], max_tokens=12,
                                       temperature=0.0, stream=True)  # fmt: skip
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == complete(reference, PROMPTS[5]).choices[0].text
    assert_all_free(prefill, decode)


def test_a_repeated_long_prompt_counts_cached_tokens_through_the_router(
    routed: openai.OpenAI, prefill: RunningServer, decode: RunningServer
) -> None:
    prompt = "A long shared system prompt about lighthouses and the sea. " * 6
    first = _create(routed, prompt).parse()
    again = _create(routed, prompt).parse()
    assert first.choices[0].text == again.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert_all_free(prefill, decode)
