"""vLLM's `structured_outputs` (regex or choice) on chat and completions: the answer follows it,
and what cannot be served is a 400 naming the field."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from densa.openai.tools.formats import HERMES
from densa.openai.tools.models import StructuredOutputs, ToolDefinition
from densa.openai.tools.plan import ToolRequestError, output_constraint, plan_tools
from densa.text.tokenizer import Tokenizer
from densa.worker.grammar import GrammarCompiler

from .support import MODEL_NAME, RunningServer

MESSAGES: list[Any] = [{"role": "user", "content": "Is the sky blue?"}]
PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.fixture(autouse=True)
def still_serving(server: RunningServer) -> Iterator[None]:
    yield
    server.wait_idle()


# ---- the grammar each becomes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def accepts(tiny_model_dir: Path) -> Callable[[StructuredOutputs, str], bool]:
    """Whether the grammar a constraint becomes accepts `text` whole (the engine's compiler)."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)

    def check(outputs: StructuredOutputs, text: str) -> bool:
        matcher = compiler.compile_now(output_constraint(outputs)).new_matcher()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())

    return check


@pytest.mark.parametrize(
    ("regex", "matches", "refuses"),
    [
        (r"a/b", ["a/b"], ["ab", "a\\/b"]),  # an unescaped slash stays a slash
        (r"a\/b", ["a/b"], ["a\\/b"]),  # so does an escaped one
        (r"c:\\d", ["c:\\d"], ["c:d", "c:1"]),  # an escaped backslash, then a letter
        (PHONE, ["555-0134"], ["555-013", "5550134"]),
    ],
)
def test_a_regex_becomes_a_grammar_of_the_same_language(
    accepts: Callable[[StructuredOutputs, str], bool],
    regex: str,
    matches: list[str],
    refuses: list[str],
) -> None:
    outputs = StructuredOutputs(regex=regex)
    for text in matches:
        assert re.fullmatch(regex, text) and accepts(outputs, text), text
    for text in refuses:
        assert not re.fullmatch(regex, text) and not accepts(outputs, text), text


def test_choices_are_quoted_exactly(accepts: Callable[[StructuredOutputs, str], bool]) -> None:
    choices = ['say "yes"', "back\\slash", "ünï", "a | b"]
    outputs = StructuredOutputs(choice=choices)
    assert all(accepts(outputs, choice) for choice in choices)
    assert not accepts(outputs, "a") and not accepts(outputs, "say yes")
    spec = output_constraint(outputs).spec
    assert spec == 'start: "say \\"yes\\"" | "back\\\\slash" | "\\u00fcn\\u00ef" | "a | b"'


def test_what_cannot_be_combined_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="exactly one of regex and choice"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of regex and choice"):
        StructuredOutputs()
    tool = ToolDefinition.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    )
    outputs = StructuredOutputs(choice=["a"])
    with pytest.raises(ToolRequestError) as caught:
        plan_tools(HERMES, [tool], "auto", None, None, outputs)
    assert caught.value.param == "structured_outputs"
    assert plan_tools(HERMES, [tool], "none", None, None, outputs).constraint is not None


# ---- through the server ------------------------------------------------------------------------
def test_a_chat_answer_is_one_of_the_choices(server: RunningServer) -> None:
    choices = ["yes", "no", "it depends"]
    for seed in range(3):  # sampled: the random tiny model would write anything unconstrained
        reply = server.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )  # fmt: skip
        assert reply.choices[0].message.content in choices
        assert reply.choices[0].finish_reason == "stop"


def test_a_completion_matches_the_regex_streamed_or_not(server: RunningServer) -> None:
    client = server.client()
    body = {"structured_outputs": {"regex": PHONE}}
    whole = client.completions.create(
        model=MODEL_NAME, prompt="Call me at", max_tokens=16, temperature=1.0, seed=1,
        extra_body=body,
    )  # fmt: skip
    assert re.fullmatch(PHONE, whole.choices[0].text), whole.choices[0].text
    chunks = client.completions.create(
        model=MODEL_NAME, prompt="Call me at", max_tokens=16, temperature=1.0, seed=2,
        stream=True, extra_body=body,
    )  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert re.fullmatch(PHONE, text), text


def test_a_regex_the_engine_cannot_compile_is_a_400(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )  # fmt: skip
    assert caught.value.body["code"] == "invalid_grammar", caught.value.body  # type: ignore[index]


def test_neither_regex_nor_choice_is_a_400_naming_the_field(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
            extra_body={"structured_outputs": {"grammar": "start: /x/"}},
        )  # fmt: skip
    body: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert "structured_outputs" in str(body.get("param")) + body["message"], body
