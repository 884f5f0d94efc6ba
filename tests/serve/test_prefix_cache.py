"""Prefix caching, tenant scopes and session affinity: at the engine, then over HTTP.

Engine-level tests drive an LLMEngine step by step and check the page pool after every step; the
HTTP tests go through the `openai` client.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from densa.cli import build_parser
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs

from ..outputs import Collector, Final
from .support import MODEL_NAME, RunningServer, make_engine

PAGE = 16  # tokens per KV page (EngineArgs' default)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def reusable(num_prompt_tokens: int) -> int:
    """Prompt tokens a repeat can take from the cache: whole pages, leaving at least one token to
    compute (its logits give the first output token)."""
    return (num_prompt_tokens - 1) // PAGE * PAGE


def random_ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256, 49152) for _ in range(count)]


def run(
    engine: LLMEngine,
    prompt_ids: list[int],
    params: SamplingParams = GREEDY,
    session_id: str | None = None,
    scope: str = "",
) -> Final:
    """Run one request to completion, checking the page pool after every step."""
    request_id = engine.add_request(prompt_ids, params, cache_scope=scope, session_id=session_id)
    collector = Collector()
    while engine.has_unfinished_requests():
        collector.add(engine.step())
        engine.check_invariants()
    final = collector.finals.get(request_id)
    assert final is not None and final.finish_reason in ("stop", "length"), final
    return final


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """(prefix caching on, prefix caching off) over the same weights."""
    yield make_engine(tiny_model_dir), make_engine(tiny_model_dir, enable_prefix_caching=False)


# ---- engine level -------------------------------------------------------------------------------
def test_greedy_output_is_the_same_with_a_prefix_hit(engines: tuple[LLMEngine, LLMEngine]) -> None:
    cached, uncached = engines
    prefix = random_ids(1, 5 * PAGE + 3)
    first = prefix + random_ids(2, 7)
    second = prefix + random_ids(3, 11)  # shares the prefix's five full pages, nothing more

    cold = run(cached, first)
    assert cold.num_cached_tokens == 0
    again = run(cached, first)
    assert again.num_cached_tokens == reusable(len(first))
    assert again.token_ids == cold.token_ids

    hit = run(cached, second)
    assert hit.num_cached_tokens == 5 * PAGE
    reference = run(uncached, second)
    assert reference.num_cached_tokens == 0
    assert hit.token_ids == reference.token_ids


def test_prefix_caching_can_be_turned_off(engines: tuple[LLMEngine, LLMEngine]) -> None:
    _, uncached = engines
    prompt = random_ids(4, 4 * PAGE)
    run(uncached, prompt)
    assert run(uncached, prompt).num_cached_tokens == 0
    assert uncached.kv_manager.num_cached_pages == 0


def test_the_cli_turns_prefix_caching_on_by_default() -> None:
    parser = build_parser()
    assert EngineArgs.from_cli(parser.parse_args(["serve"])).enable_prefix_caching
    off = parser.parse_args(["serve", "--no-enable-prefix-caching"])
    assert not EngineArgs.from_cli(off).enable_prefix_caching


def test_scopes_do_not_share_pages(engines: tuple[LLMEngine, LLMEngine]) -> None:
    cached, _ = engines
    prompt = random_ids(5, 4 * PAGE + 1)
    run(cached, prompt, scope="tenant-a")
    assert run(cached, prompt, scope="tenant-b").num_cached_tokens == 0
    assert run(cached, prompt, scope="tenant-a").num_cached_tokens == 4 * PAGE


@pytest.mark.parametrize("with_session", [True, False])
def test_session_pages_survive_pressure_that_evicts_others(
    tiny_model_dir: Path, with_session: bool
) -> None:
    """A pool of 36 pages; a 511-token request needs 32 of them. It evicts every cached page that
    is not protected by a session -- and, without the session header, the chat's pages too."""
    engine = make_engine(tiny_model_dir, num_kv_pages=36)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    chat = random_ids(6, 4 * PAGE)
    other = random_ids(7, 4 * PAGE)
    run(engine, chat, one_token, session_id="conversation-1" if with_session else None)
    run(engine, other, one_token)
    run(engine, random_ids(8, 32 * PAGE - 1), one_token)  # the pressure

    next_turn = chat + random_ids(9, PAGE)
    expected = 4 * PAGE if with_session else 0
    assert run(engine, next_turn, one_token).num_cached_tokens == expected
    assert run(engine, other + random_ids(10, PAGE), one_token).num_cached_tokens == 0
    assert engine.kv_manager.num_free_pages == engine.kv_manager.num_pages


# ---- over HTTP ----------------------------------------------------------------------------------
def long_messages(num_words: int = 60) -> list[Any]:
    """A prompt of several pages that no other test sends (the server is shared)."""
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(num_words))
    return [{"role": "user", "content": f"Summarize: {words}"}]


def test_http_greedy_output_and_usage_with_a_prefix_hit(server: RunningServer) -> None:
    client = server.client()
    messages = long_messages()
    greedy: dict[str, Any] = {
        "temperature": 0,
        "max_tokens": 12,
        # A scope of its own: the chat template's system prompt is cached by other tests.
        "extra_body": {"ignore_eos": True, "cache_salt": uuid.uuid4().hex},
    }

    cold = client.chat.completions.create(model=MODEL_NAME, messages=messages, **greedy)
    warm = client.chat.completions.create(model=MODEL_NAME, messages=messages, **greedy)
    assert cold.usage and cold.usage.prompt_tokens_details and warm.usage
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    num_prompt = cold.usage.prompt_tokens
    assert warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens == reusable(num_prompt)
    assert warm.choices[0].message.content == cold.choices[0].message.content

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **greedy,
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == reusable(num_prompt)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == cold.choices[0].message.content


def test_completions_report_cached_tokens_when_streaming(server: RunningServer) -> None:
    client = server.client()
    prompt = random_ids(11, 3 * PAGE + 5)

    def cached(stream: bool) -> int:
        if not stream:
            response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
            usage = response.usage
        else:
            chunks = list(
                client.completions.create(
                    model=MODEL_NAME,
                    prompt=prompt,
                    max_tokens=2,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    assert cached(stream=False) == 0
    assert cached(stream=True) == 3 * PAGE
    assert cached(stream=False) == 3 * PAGE


def test_api_keys_are_separate_cache_scopes(server: RunningServer, api_keys: Any) -> None:
    api_keys("key-a", "key-b")
    messages = long_messages()

    def cached_tokens(key: str) -> int:
        response = server.client(api_key=key).chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=1
        )
        assert response.usage and response.usage.prompt_tokens_details
        return response.usage.prompt_tokens_details.cached_tokens or 0

    assert cached_tokens("key-a") == 0
    assert cached_tokens("key-b") == 0  # the same prompt, another tenant: nothing to probe
    assert cached_tokens("key-a") > 0
    assert cached_tokens("key-b") > 0


def test_multi_turn_chat_with_session_affinity_caches_more_each_turn(
    server: RunningServer,
) -> None:
    client = server.client()
    session = {"x-session-affinity": f"chat-{uuid.uuid4().hex}"}
    scope = {"cache_salt": uuid.uuid4().hex}  # nothing cached before turn 1, not even the template
    messages: list[Any] = long_messages(num_words=10)
    cached_per_turn = []
    for turn in range(4):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_headers=session,
            extra_body=scope,
        )
        assert response.usage and response.usage.prompt_tokens_details
        cached_per_turn.append(response.usage.prompt_tokens_details.cached_tokens or 0)
        answer = response.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Turn {turn}: " + "tell me more, please. " * 6},
        ]
    assert cached_per_turn[0] == 0
    assert all(a < b for a, b in itertools.pairwise(cached_per_turn))


def _cached_tokens(
    server: RunningServer, messages: list[Any], headers: dict[str, str], **body: Any
) -> int:
    import httpx

    request = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, **body}
    response = httpx.post(
        server.base_url + "/v1/chat/completions", json=request, headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_header_spellings_of_one_key_share_one_scope(server: RunningServer, api_keys: Any) -> None:
    api_keys("key-c")
    messages = long_messages()
    assert _cached_tokens(server, messages, {"authorization": "Bearer key-c"}) == 0
    for spelling in ("bearer key-c", "BEARER key-c", "Bearer  key-c"):
        assert _cached_tokens(server, messages, {"authorization": spelling}) > 0, spelling


def test_user_and_salt_cannot_be_spelled_into_each_other(server: RunningServer) -> None:
    messages, headers = long_messages(), {"authorization": "Bearer k"}
    assert _cached_tokens(server, messages, headers, user="u", cache_salt="s") == 0
    # The old "|"-joined scope made these two the same string.
    assert _cached_tokens(server, messages, headers, user="u|salt:s") == 0
    assert _cached_tokens(server, messages, headers, user="u", cache_salt="s") > 0


def test_pages_shared_by_running_requests_are_released_by_both(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """Two requests hold the same prefix pages at once (reference count 2); each release drops
    one reference, and once both are done every page is free again."""
    engine, _ = engines
    prefix = random_ids(21, 4 * PAGE)
    first = engine.add_request(prefix + random_ids(22, 5), GREEDY)
    while engine.scheduler.requests[first].num_output_tokens == 0:  # prefill done, pages indexed
        engine.step()
        engine.check_invariants()
    second = engine.add_request(prefix + random_ids(23, 9), GREEDY)
    engine.step()
    engine.check_invariants()
    a, b = engine.scheduler.requests[first], engine.scheduler.requests[second]
    shared = set(a.page_ids) & set(b.page_ids)
    assert len(shared) == 4 and b.num_cached_tokens == 4 * PAGE
    assert all(engine.kv_manager.pool.ref_count(p) == 2 for p in shared)
    engine.abort_request(first)  # one owner leaves early: the pages stay with the other
    engine.check_invariants()
    assert all(engine.kv_manager.pool.ref_count(p) == 1 for p in shared)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    pool = engine.kv_manager.pool
    assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages))
    assert engine.kv_manager.num_free_pages == engine.kv_manager.num_pages
