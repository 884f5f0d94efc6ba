"""What frameworks rely on beyond the OpenAI spec: unknown fields ignored (with a warning and a
header) unless --strict-api, and model aliases or any model name, echoed back."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from densa.openai.unknown_fields import MAX_HEADER_FIELDS, IgnoredFieldLog, header_value
from densa.serve.scrape import scrape

from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer

CHAT = "/v1/chat/completions"
HEADER = "x-densa-ignored-fields"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def still_serving(server: RunningServer) -> Iterator[None]:
    yield
    server.wait_idle()


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    """The WARNING lines of densa.openai.unknown_fields while the test runs."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("densa.openai.unknown_fields")
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


# ---- unknown fields -----------------------------------------------------------------------------
def test_unknown_fields_are_ignored_and_named_in_a_header(server: RunningServer) -> None:
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0,
        extra_body={"guided_decoding_backend": "auto", "chat_id": 7},
    )  # fmt: skip
    assert raw.http_response.status_code == 200
    assert raw.headers[HEADER] == "guided_decoding_backend,chat_id"
    assert raw.parse().usage is not None and raw.parse().usage.completion_tokens == 2


def test_streamed_responses_carry_the_header_too(server: RunningServer) -> None:
    client = server.client()
    with client.chat.completions.with_streaming_response.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, stream=True,
        extra_body={"x_vendor_option": True},
    ) as response:  # fmt: skip
        assert response.headers[HEADER] == "x_vendor_option"
        chunks = list(response.parse())
    assert chunks[-1].choices[0].finish_reason == "length"
    completion = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt="Once", max_tokens=2, extra_body={"best_of_n_other": 2}
    )
    assert completion.headers[HEADER] == "best_of_n_other"


def test_a_request_without_unknown_fields_has_no_header(server: RunningServer) -> None:
    response = post(server, CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1})
    assert response.status_code == 200
    assert HEADER not in response.headers


def test_nested_unknown_fields_are_named_by_path_once(server: RunningServer) -> None:
    """Clients echo whole assistant messages back (`refusal`, `annotations`, ...)."""
    messages = [
        {"role": "user", "content": "hi", "x_meta": 1},
        {"role": "assistant", "content": "hello", "refusal": None, "annotations": []},
        {"role": "user", "content": "again", "x_meta": 2},
    ]
    tool_choice = {"type": "function", "function": {"name": "f"}, "x_tag": "a"}  # in a union
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, "tools": tools,
            "tool_choice": tool_choice}  # fmt: skip
    response = post(server, CHAT, body)
    assert response.status_code == 200, response.text
    names = response.headers[HEADER].split(",")
    expected = [
        "messages[].x_meta",
        "messages[].refusal",
        "messages[].annotations",
        "tool_choice.x_tag",
    ]
    assert sorted(names) == sorted(expected)


def test_known_fields_are_still_validated_beside_unknown_ones(server: RunningServer) -> None:
    for field, value in (("temperature", "hot"), ("max_tokens", 10**9), ("n", 0)):
        body = {"model": MODEL_NAME, "messages": MESSAGES, field: value, "x_unknown": 1}
        response = post(server, CHAT, body)
        assert response.status_code == 400, field
        assert response.json()["error"]["param"] == field
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, extra_body={"x_unknown": 1, "top_k": "ten"}
        )
    assert caught.value.body["param"] == "top_k"  # type: ignore[index]


def test_a_warning_is_logged_once_per_field_name(
    server: RunningServer, warnings_logged: list[str]
) -> None:
    name = f"x_{uuid.uuid4().hex[:8]}"  # new to this server
    for _ in range(3):
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, name: 1}
        assert post(server, CHAT, body).status_code == 200
    assert len([line for line in warnings_logged if name in line]) == 1


def test_hostile_field_names_make_a_short_safe_header(server: RunningServer) -> None:
    fields = {f"f{i}": i for i in range(40)}
    fields["a,b\r\nx-evil: 1 é"] = 1
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, **fields}
    response = post(server, CHAT, body)
    assert response.status_code == 200
    assert "x-evil" not in response.headers
    value = response.headers[HEADER]
    assert value.isascii() and len(value.split(",")) == MAX_HEADER_FIELDS + 1
    assert value.endswith(",+25")


def test_strict_api_refuses_what_the_default_ignores(
    server: RunningServer, api_options: Any
) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi", "x": 1}]}
    api_options(strict_api=True)
    response = post(server, CHAT, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].x"
    assert response.json()["error"]["code"] == "unknown_parameter"


def test_header_value_and_log_bounds(warnings_logged: list[str]) -> None:
    assert header_value(["a", "b[].c"]) == "a,b[].c"
    assert header_value(["x" * 500]) == "x" * 64
    log = IgnoredFieldLog(max_names=3)
    log.note("/v1/chat/completions", ["a", "b", "a", "c", "d", "e"])
    log.note("/v1/chat/completions", ["f", "a"])
    assert len(warnings_logged) == 4  # a, b, c, then "naming no more" once
    assert "naming no more" in warnings_logged[-1]


# ---- model names --------------------------------------------------------------------------------
def test_aliases_are_listed_served_and_echoed(server: RunningServer, api_options: Any) -> None:
    api_options(served_model_names=("densa-main", "gpt-4o-mini"))
    client = server.client()
    assert [m.id for m in client.models.list()] == ["densa-main", "gpt-4o-mini"]
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    for name in ("densa-main", "gpt-4o-mini"):
        response = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1)
        assert response.model == name
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert "'densa-main', 'gpt-4o-mini'" in str(caught.value)


def test_any_model_name_is_served_and_echoed(server: RunningServer, api_options: Any) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="claude-x", prompt="hi", max_tokens=1)
    api_options(accept_any_model_name=True)
    stream = client.chat.completions.create(
        model="claude-x", messages=MESSAGES, max_tokens=2, stream=True
    )
    assert {chunk.model for chunk in stream} == {"claude-x"}
    assert client.completions.create(model="gpt-3.5", prompt="hi", max_tokens=1).model == "gpt-3.5"
    assert client.models.retrieve("anything").id == "anything"
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


# ---- /tokenize and /detokenize ------------------------------------------------------------------
def test_tokenize_text_and_detokenize_round_trip(server: RunningServer) -> None:
    text = "The sea is salty."
    response = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == server.tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == server.tokenizer.convert_ids_to_tokens(body["tokens"])
    back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.json() == {"prompt": server.tokenizer.decode(body["tokens"], False)}
    assert post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None


def test_tokenize_chat_gives_the_ids_a_chat_completion_runs(server: RunningServer) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    response = post(server, "/tokenize", {"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 200, response.text
    completion = server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1
    )
    assert completion.usage is not None
    assert response.json()["count"] == completion.usage.prompt_tokens
    assert response.json()["tokens"] == server.tokenizer.encode_chat(messages)
    assert response.json()["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            None,
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
            400,
            "add_special_tokens",
        ),
    ],
)
def test_tokenize_refuses_what_it_cannot_do(
    server: RunningServer, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    response = post(server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


# ---- logit_bias ---------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens(server: RunningServer) -> None:
    """+100 all but forces a token, -100 bans it: `sea` wins over a +90 `land` until banned."""
    client = server.client()
    [sea] = server.tokenizer.encode(" sea", add_special_tokens=False)
    [land] = server.tokenizer.encode(" land", add_special_tokens=False)

    def text(bias: dict[str, int]) -> str:
        response = client.completions.create(
            model=MODEL_NAME, prompt="Once", max_tokens=3, temperature=0, logit_bias=bias
        )
        return response.choices[0].text

    assert text({str(sea): 100, str(land): 90}) == server.tokenizer.decode([sea] * 3)
    assert text({str(sea): -100, str(land): 90}) == server.tokenizer.decode([land] * 3)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0, logit_bias={str(sea): 100}
    )
    assert chat.choices[0].message.content == server.tokenizer.decode([sea] * 2)


@pytest.mark.parametrize(
    "bias", [{"49152": 1}, {"5": 100.5}, {"5": -101}, {"five": 1}, {"05": 1}, {"5": "1"}]
)
def test_logit_bias_out_of_range_is_a_400(server: RunningServer, bias: dict[str, Any]) -> None:
    response = post(server, CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "logit_bias": bias})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("logit_bias")


# ---- n > 1 --------------------------------------------------------------------------------------
def test_n_choices_share_the_prompts_pages(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Choices 1 and 2 start from the pages choice 0 computed (the engine's prefix hits); seeded
    choices differ from each other and are reproducible. The usage, the request's log line and
    /metrics agree: the prompt once with the tokens cached when the request came (a new prompt:
    at most the template's first page), every choice's completion tokens (before: cached_tokens summed over the choices,
    more than the prompt)."""
    client = server.client()
    messages: list[Any] = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "wave " * 80}]
    num_prompt = len(server.tokenizer.encode_chat(messages))
    server.wait_idle()
    before, hits_before = scrape(server.base_url), server.stats.num_prefix_hit_tokens
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "n": 3, "max_tokens": 4,
                              "seed": 5, "temperature": 1.0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    logger = logging.getLogger("densa.requests")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="densa.requests"):
            response = client.chat.completions.create(**kwargs)
            server.wait_idle()
    finally:
        logger.removeHandler(caplog.handler)
    after = scrape(server.base_url)
    assert server.stats.num_prefix_hit_tokens - hits_before >= 2 * ((num_prompt - 1) // 16 * 16)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    texts = [choice.message.content for choice in response.choices]
    assert len(set(texts)) == 3
    assert response.usage is not None
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens_details is not None
    # At most the chat template's opening page was cached before (other tests share it).
    cached = response.usage.prompt_tokens_details.cached_tokens
    assert cached in (0, 16)
    # (one line, possibly seen twice: by the handler added here and through propagation)
    [line] = {r.getMessage() for r in caplog.records if response.id in r.getMessage()}
    assert f"prompt_tokens={num_prompt} cached_tokens={cached} completion_tokens=12" in line
    for name, value in [("densa_prompt_tokens_total", num_prompt),
                        ("densa_cached_prompt_tokens_total", cached),
                        ("densa_generation_tokens_total", 12)]:  # fmt: skip
        assert after.value(name) - before.value(name) == value, name
    again = client.chat.completions.create(**kwargs)
    assert [choice.message.content for choice in again.choices] == texts


def test_streamed_choices_reassemble_to_the_whole_ones(server: RunningServer) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Once upon", "n": 3, "max_tokens": 5,
                              "seed": 11, "temperature": 1.0}  # fmt: skip
    whole = client.completions.create(**kwargs)
    texts, finishes = ["", "", ""], [0, 0, 0]
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kwargs):  # fmt: skip
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] += choice.finish_reason is not None
        usage = chunk.usage or usage
    assert texts == [choice.text for choice in whole.choices]
    assert finishes == [1, 1, 1]
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_too_many_choices_is_a_400(server: RunningServer) -> None:
    response = post(server, CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "n": 17})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
