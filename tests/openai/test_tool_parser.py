"""The front's tool pieces without a server: the streaming parser (every split of the text gives
the whole-text result), the call grammars (they accept exactly the calls the parser reads), the
schema feature check, and that none of it imports torch or the grammar engine."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from densa.openai.tools.deltas import to_deltas
from densa.openai.tools.formats import HERMES, LLAMA3_JSON, ToolCallFormat
from densa.openai.tools.parser import (
    CallArguments,
    CallStart,
    Content,
    ToolCallParser,
    parse_output,
)
from densa.openai.tools.schema_check import UnsupportedSchema, check_schema

CASES: list[tuple[ToolCallFormat, str, str, list[tuple[str, str]]]] = [
    (
        HERMES,
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n'
        '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        "Sure.",
        [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("b", "{}")],
    ),
    (HERMES, "no calls here < tool > ok\n", "no calls here < tool > ok\n", []),
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "name": "late"}\n</tool_call> after', " after", [("late", '{"x": 1}')]),
    (HERMES, "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (HERMES, '<tool_call>\n{"name": "cut", "arguments": {"x": "abc', "", [("cut", '{"x": "abc')]),
    (HERMES, '<tool_call>{"name": "esc\\"q", "arguments": {"k": "a\\\\"}}</tool_call>', "", [('esc"q', '{"k": "a\\\\"}')]),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"q": "x y"}}; {"name": "g", "parameters": {"z": 2}}', "", [("f", '{"q": "x y"}'), ("g", '{"z": 2}')]),
    (LLAMA3_JSON, 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parser_reads_content_and_calls(
    fmt: ToolCallFormat, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    parsed = parse_output(fmt, text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_stream_gives_the_whole_result(
    fmt: ToolCallFormat, text: str, content: str, calls: list[tuple[str, str]], seed: int
) -> None:
    rng = random.Random(seed)
    parser = ToolCallParser(fmt)
    events, start = [], 0
    while start < len(text):
        end = start + rng.randint(1, 7)
        events += parser.feed(text[start:end])
        start = end
    events += parser.finish()
    assert "".join(e.text for e in events if isinstance(e, Content)) == content
    streamed: list[list[str]] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(streamed)
            streamed.append([event.name, ""])
        elif isinstance(event, CallArguments):
            streamed[event.index][1] += event.text
    assert [tuple(c) for c in streamed] == calls
    # As OpenAI deltas: the start of a call carries id and name, fragments only arguments.
    for delta in to_deltas(events):
        if delta.tool_call is not None and delta.tool_call.id is not None:
            assert delta.tool_call.function.arguments == ""


WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
HERMES_WEATHER = HERMES.with_tools(WEATHER_TOOLS)

# Fenced JSON blocks (what small Qwen2.5 models write when not constrained): a call only when it
# names an offered tool with an arguments object; anything else stays content, byte for byte.
FENCED_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```', "", [("get_weather", '{"city": "Paris"}')]),
    ('I will look.\n```\n{"name": "get_weather", "arguments": {}}\n```\nDone.', "I will look.\nDone.", [("get_weather", "{}")]),
    ('```json\n{"name": "get_weather", "arguments": {"a": 1}}\n```\n```json\n{"name": "get_weather", "arguments": {"a": 2}}\n```', "", [("get_weather", '{"a": 1}'), ("get_weather", '{"a": 2}')]),
    ('Example:\n```json\n{"name": "rm_rf", "arguments": {}}\n```\nok', 'Example:\n```json\n{"name": "rm_rf", "arguments": {}}\n```\nok', []),
    ('```json\n{"name": "get_weather", "arguments": "Paris"}\n```', '```json\n{"name": "get_weather", "arguments": "Paris"}\n```', []),
    ("Use:\n```python\nprint(1)\n```", "Use:\n```python\nprint(1)\n```", []),
    ('Text\n```json\n[1, 2]\n```\n', 'Text\n```json\n[1, 2]\n```\n', []),
    ("a `b` and ``c`` end `", "a `b` and ``c`` end `", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"x": 1}}\n</tool_call>', "", [("get_weather", '{"x": 1}')]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), FENCED_CASES)
@pytest.mark.parametrize("seed", range(8))
def test_fenced_blocks_naming_an_offered_tool_are_calls(
    text: str, content: str, calls: list[tuple[str, str]], seed: int
) -> None:
    rng = random.Random(seed)
    parser = ToolCallParser(HERMES_WEATHER)
    events, start = [], 0
    while start < len(text):
        end = start + (len(text) if seed == 0 else rng.randint(1, 5))  # seed 0: the whole text
        events += parser.feed(text[start:end])
        start = end
    events += parser.finish()
    assert "".join(e.text for e in events if isinstance(e, Content)) == content
    assert [(c.name, c.arguments) for c in parser.calls] == calls


def test_fenced_blocks_stay_content_without_tools_and_in_other_dialects() -> None:
    text = '```json\n{"name": "get_weather", "arguments": {}}\n```'
    assert parse_output(HERMES, text).content == text  # no tools offered: nothing to call
    llama = LLAMA3_JSON.with_tools(WEATHER_TOOLS)
    assert parse_output(llama, text).tool_calls == []


def test_arguments_stream_before_the_call_is_closed() -> None:
    parser = ToolCallParser(HERMES)
    events = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert [type(e) for e in events] == [CallStart, CallArguments]
    assert events[1] == CallArguments(0, '{"city": "Par')


TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
    {"type": "function", "function": {"name": "ping"}},
]  # fmt: skip


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_call_grammars_accept_exactly_valid_calls(fmt: ToolCallFormat, smollm2_dir: Path) -> None:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(smollm2_dir)))
    grammar = fmt.call_grammar(TOOLS, parallel=True)
    assert grammar.kind == "lark"

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(
            tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.spec), log_level=0
        )
        ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
        return ok and matcher.is_accepting()

    good = fmt.render_calls(
        [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "ping", "arguments": {}}]
    )
    assert accepts(good)
    assert [c.name for c in parse_output(fmt, good).tool_calls] == ["get_time", "ping"]
    assert not accepts(fmt.render_calls([{"name": "get_time", "arguments": {"zone": "PST"}}]))
    assert not accepts(fmt.render_calls([{"name": "other", "arguments": {}}]))
    assert not accepts("I think it is noon.")
    single = fmt.call_grammar(TOOLS, parallel=False)
    matcher = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_lark(single.spec), log_level=0
    )
    assert not matcher.consume_tokens(tokenizer.tokenize_str(good))  # one call only


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "schema.properties.a.if"),
        ({"anyOf": [{"type": "string"}, {"not": {}}]}, "schema.anyOf[1].not"),
        ({"type": "array", "items": {"uniqueItems": True}}, "schema.items.uniqueItems"),
        ({"$ref": "other.json#/a"}, "local references"),
        ({"type": "object", "properties": []}, "object of schemas"),
        ([], "must be a JSON object"),
    ],
)
def test_unsupported_schema_features_are_named(schema: object, message: str) -> None:
    with pytest.raises(UnsupportedSchema, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_schema(schema)


def test_supported_schemas_pass() -> None:
    from densa_bench.structured.schemas import SCHEMA_CASES

    for case in SCHEMA_CASES:
        check_schema(case.schema)
    check_schema(
        {"type": "object", "patternProperties": {"^a": {"type": "string"}}, "minProperties": 1}
    )


def test_deep_schemas_are_refused() -> None:
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    with pytest.raises(UnsupportedSchema, match="deeper"):
        check_schema(schema)


def test_the_front_tool_modules_import_without_torch_or_the_grammar_engine() -> None:
    """serve/__init__ still imports the engine (the process split removes that); the tool
    modules themselves, loaded under a bare `densa.serve` package, must not need torch."""
    root = Path(__file__).resolve().parents[2]
    code = f"""
import sys, types
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "llguidance", "numpy"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
serve = types.ModuleType("densa.serve")
serve.__path__ = [{str(root / "densa" / "serve")!r}]
sys.modules["densa.serve"] = serve
import densa.openai.tools.plan, densa.openai.tools.parser, densa.openai.tools.deltas
import densa.openai.tools.render, densa.openai.tools.models, densa.openai.tools.schema_check
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_tool_definitions_render_for_templates_without_tool_support() -> None:
    from densa.openai.tools.render import render_messages

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "12:00"},
    ]
    rendered = render_messages(messages, TOOLS, HERMES, template_renders_tools=False)
    assert rendered[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(TOOLS[0]) in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    }
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\n12:00\n</tool_response>"}
    native = render_messages(messages, TOOLS, HERMES, template_renders_tools=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
