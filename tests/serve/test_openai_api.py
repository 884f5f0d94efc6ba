"""The OpenAI endpoints through the official `openai` client: shapes, usage, sampling, logprobs."""

from __future__ import annotations

from typing import Any

import pytest

from densa.cache.scope import CacheScope, tenant_of
from densa.openai.responses import TokenTexts

from .support import MODEL_NAME, RunningServer

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def chat_text(server: RunningServer, **kwargs: Any) -> str:
    response = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, **kwargs
    )
    return response.choices[0].message.content or ""


def test_chat_completion_shape_and_usage(server: RunningServer) -> None:
    response = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, **GREEDY
    )
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == MODEL_NAME
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    prompt_ids = server.tokenizer.encode_chat(MESSAGES)
    usage = response.usage
    assert usage is not None
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == 8
    assert usage.total_tokens == len(prompt_ids) + 8
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_matches_non_streaming(server: RunningServer) -> None:
    stream = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert streamed == chat_text(server, max_tokens=12, **GREEDY)


def test_completion_shape_usage_and_stream(server: RunningServer) -> None:
    client = server.client()
    prompt = "Once upon a time"
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, **GREEDY)
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    [choice] = response.choices
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(server.tokenizer.encode(prompt))
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_completion_accepts_token_ids(server: RunningServer) -> None:
    client = server.client()
    prompt = "The sea is"
    ids = server.tokenizer.encode(prompt)
    by_text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_greedy_is_deterministic(server: RunningServer) -> None:
    assert chat_text(server, max_tokens=10, **GREEDY) == chat_text(server, max_tokens=10, **GREEDY)


def test_seed_reproduces_sampling(server: RunningServer) -> None:
    sampled = {"temperature": 1.0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
    first = chat_text(server, seed=1234, **sampled)
    assert chat_text(server, seed=1234, **sampled) == first
    assert chat_text(server, seed=4321, **sampled) != first


def test_stop_string_cuts_the_text(server: RunningServer) -> None:
    full = chat_text(server, max_tokens=24, **GREEDY)
    stop = full[10:13]
    cut = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=24, stop=[stop], **GREEDY
    )
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs(server: RunningServer) -> None:
    response = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    [choice] = response.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    joined = b"".join(bytes(entry.bytes or []) for entry in content)
    assert joined.decode() == choice.message.content


def test_chat_logprobs_stream(server: RunningServer) -> None:
    chunks = list(
        server.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True, stream=True, **GREEDY
        )
    )
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert len(entries) == 5
    assert all(e.top_logprobs == [] for e in entries)


def _a_later_token(server: RunningServer, texts: list[str]) -> tuple[int, int]:
    """(index, id) of an output token past the first that is one token on its own and occurs
    once: a stop token there ends the answer at that index."""
    for idx, text in enumerate(texts[1:], start=1):
        ids = server.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and texts.count(text) == 1:
            return idx, ids[0]
    raise AssertionError(f"no usable token in {texts}")


@pytest.mark.parametrize("stream", [False, True])
def test_the_token_that_ends_the_answer_is_not_in_its_logprobs(
    server: RunningServer, stream: bool
) -> None:
    """A stop token (EOS, or here a stop_token_ids entry, the same rule) ends the answer: it is
    counted in completion_tokens but, as OpenAI lists only the returned text's tokens, it has
    no logprobs entry (before: one entry too many, `<|im_end|>` joined to the content)."""
    chat = server.client().chat.completions.create
    full = chat(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, logprobs=True, **GREEDY)
    assert full.choices[0].logprobs is not None and full.choices[0].logprobs.content
    texts = [entry.token for entry in full.choices[0].logprobs.content]
    end, stop_id = _a_later_token(server, texts)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8,
                              "logprobs": True, "temperature": 0,
                              "extra_body": {"ignore_eos": True, "stop_token_ids": [stop_id]}}  # fmt: skip
    if stream:
        chunks = list(chat(stream=True, stream_options={"include_usage": True}, **kwargs))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content or []]  # fmt: skip
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        response = chat(**kwargs)
        assert response.choices[0].logprobs is not None
        entries = response.choices[0].logprobs.content or []
        content = response.choices[0].message.content or ""
        finish, usage = response.choices[0].finish_reason, response.usage
    assert finish == "stop"
    assert [e.token for e in entries] == texts[:end]
    assert b"".join(bytes(e.bytes or []) for e in entries).decode() == content
    assert usage is not None and usage.completion_tokens == end + 1  # the stop token counts


def test_completion_logprobs(server: RunningServer) -> None:
    response = server.client().completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=5, logprobs=2, **GREEDY
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == 5
    assert logprobs.top_logprobs is not None
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == response.choices[0].text


def test_models_lists_the_served_name(server: RunningServer) -> None:
    client = server.client()
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_prefix_cache_is_scoped(server: RunningServer) -> None:
    """A repeated prompt hits the prefix cache, but only within the same key/user/cache_salt."""
    messages: list[Any] = [{"role": "user", "content": "word " * 80}]

    def cached_tokens(**extra: Any) -> int:
        response = server.client().chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=1, **extra
        )
        assert response.usage and response.usage.prompt_tokens_details
        return response.usage.prompt_tokens_details.cached_tokens or 0

    cached_tokens(extra_body={"cache_salt": "a"})
    assert cached_tokens(extra_body={"cache_salt": "a"}) >= 64
    assert cached_tokens(extra_body={"cache_salt": "b"}) == 0
    assert cached_tokens(extra_body={"cache_salt": "a"}, user="someone") == 0


def test_session_and_scope_reach_the_engine(limited_server: RunningServer, scripted: Any) -> None:
    limited_server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=1,
        user="u1",
        extra_headers={"x-session-affinity": "sess-7"},
        extra_body={"cache_salt": "salt"},
    )
    [call] = scripted.calls
    assert call["session_id"] == "sess-7"
    assert call["request_id"].startswith("chatcmpl-")
    # The scope is the digest of (the key's identity, user, salt), not a string of them.
    expected = CacheScope(tenant=tenant_of("test-key"), user="u1", salt="salt").digest()
    assert call["cache_scope"] == expected


def test_content_parts_and_developer_role(server: RunningServer) -> None:
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "about the sea."}]
    messages: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": parts},
    ]
    response = server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1
    )
    expected = server.tokenizer.encode_chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me\nabout the sea."},
        ]
    )
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected)


def test_token_bytes_rebuild_split_characters(server: RunningServer) -> None:
    """Tokens may hold part of a UTF-8 character: their bytes, joined, give back the text."""
    text = "héllo 日本語 🙂"
    token_texts = TokenTexts(server.tokenizer)
    token_ids = server.tokenizer.encode(text, add_special_tokens=False)
    assert any(token_texts.text(t) == "\ufffd" for t in token_ids)  # some token is a split char
    assert b"".join(bytes(token_texts.get(t)[1]) for t in token_ids).decode() == text
