"""Each tool-call dialect against its family's real chat template (fixtures/chat_templates): the
dialect is detected from the template; a conversation with two calls, rendered by the template
through densa's prompt path, parses back to those calls (streamed in any split, or whole); the
dialect writes calls exactly as the template does; and a forced call goes through the grammar
on a tokenizer whose markers are tokens -- matched as those tokens.

Tokenizers: Qwen2.5's (hermes, with its own template; from the catalog's GGUF) and DeepSeek's
(fixtures/tokenizers) are real. For Llama 3, Kimi K2, GLM, Qwen3-Coder and Mistral none is
available here (fixtures/tokenizers/README.md): SmolLM2's tokenizer with the family's markers
added as tokens stands in for the real one.
"""

from __future__ import annotations

import json
import lzma
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from densa.ipc.messages import TokenizerFiles
from densa.model.loader import resolve_model_dir
from densa.openai.tools.formats import detect_format, format_for, tool_format
from densa.openai.tools.models import ToolDefinition
from densa.openai.tools.parser import (
    CallArguments,
    CallStart,
    Content,
    ToolCallParser,
    parse_output,
)
from densa.openai.tools.plan import plan_tools
from densa.openai.tools.render import render_messages
from densa.text.detokenizer import Detokenizer
from densa.text.tokenizer import Tokenizer
from densa.worker.grammar import GrammarCompiler

FIXTURES = Path(__file__).parent / "fixtures"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "ping"}},
]  # fmt: skip
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
    {"name": "ping", "arguments": {}},
]


@dataclass(frozen=True)
class Family:
    dialect: str
    template: str  # file in fixtures/chat_templates
    markers: tuple[str, ...]  # added tokens of the stand-in tokenizer (() = the real tokenizer)
    end_of_turn: str  # where the rendered assistant turn ends
    call_ids: tuple[str, str] = ("call_0123456789abcdef", "call_fedcba9876543210")
    writes_like_template: bool = True  # the template writes the calls as the dialect does
    turn_start: str = ""  # the turn follows this (else: what the bare prompt renders)
    num_calls: int = 2  # calls in the rendered turn (Llama 3.1 makes one at a time)
    starts_with_marker: bool = True  # a call begins with a marker (Llama 3's is bare JSON)
    real_model: str = ""  # a catalog model whose own tokenizer and template these are

    def __str__(self) -> str:
        return self.dialect


FAMILIES = [
    Family("hermes", "", (), "<|im_end|>", real_model="qwen2.5-coder-0.5b"),
    Family("llama3_json", "llama3_1_json.jinja",
           ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|python_tag|>"), "<|eot_id|>", num_calls=1, starts_with_marker=False),
    Family("kimi_k2", "kimi_k2_thinking.jinja",
           ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
           "<|im_end|>", call_ids=("functions.get_weather:0", "functions.ping:1")),
    Family("deepseek_v3", "deepseek_v3.jinja", (), "<｜end▁of▁sentence｜>"),
    Family("deepseek_v31", "deepseek_v3_1.jinja", (), "<｜end▁of▁sentence｜>"),
    Family("glm", "glm_4_6.jinja",
           ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
           "<|assistant|>"),
    Family("qwen3_coder", "qwen3_coder.jinja",
           ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"), "<|im_end|>"),
    Family("mistral", "devstral_small_2.jinja",
           ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
            "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
            "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"), "</s>"),
    Family("mistral_json", "mistral_parallel.jinja",
           ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "</s>",
           writes_like_template=False,  # its template adds each call's id to the JSON
           turn_start="[/INST]"),  # its prompt moves the system text into the last [INST]
]  # fmt: skip


def tokenizer_for(family: Family, model_dir: Path) -> Tokenizer:
    """The family's tokenizer: a real one (a catalog model's folder, or DeepSeek's), or the one
    in `model_dir` with the family's markers added, standing in for it."""
    if family.real_model:
        return Tokenizer.from_dir(model_dir)
    template = (FIXTURES / "chat_templates" / family.template).read_text(encoding="utf-8")
    if not family.markers:  # DeepSeek's real tokenizer
        folder = FIXTURES / "tokenizers"
        text = lzma.decompress((folder / "deepseek_tokenizer.json.xz").read_bytes()).decode()
        config = (folder / "deepseek_tokenizer_config.json").read_text(encoding="utf-8")
        return Tokenizer(TokenizerFiles(text, config, template))
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer

    rust = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
    rust.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in family.markers])
    config = json.dumps({"eos_token": family.end_of_turn, "bos_token": family.markers[0]})
    return Tokenizer(TokenizerFiles(rust.to_str(), config, template))


@pytest.fixture(scope="module", params=FAMILIES, ids=str)
def family(request: pytest.FixtureRequest) -> Family:
    return request.param


@pytest.fixture(scope="module")
def tokenizer(family: Family, smollm2_dir: Path, request: pytest.FixtureRequest) -> Tokenizer:
    if family.real_model:
        real_model = request.getfixturevalue("real_model")
        return tokenizer_for(family, resolve_model_dir(str(real_model(family.real_model))))
    return tokenizer_for(family, smollm2_dir)


def assistant_turn(family: Family, tokenizer: Tokenizer) -> str:
    """The text the template renders for an assistant turn that made CALLS."""
    ask = [{"role": "user", "content": "Weather in Paris for 3 days, then ping."}]
    calls = [
        {"id": call_id, "type": "function", "function": {"name": c["name"],
         "arguments": json.dumps(c["arguments"])}}
        for call_id, c in zip(family.call_ids, CALLS[: family.num_calls], strict=False)
    ]  # fmt: skip
    turn = [*ask, {"role": "assistant", "content": "", "tool_calls": calls}]

    def render(messages: list[dict[str, Any]]) -> str:  # as the server renders a prompt
        renders_tools = tokenizer.template_renders_tools
        fmt, renders_calls = tool_format(family.dialect), tokenizer.template_renders_tool_calls
        messages = render_messages(messages, TOOLS, fmt, renders_tools, renders_calls)
        return tokenizer.render_chat(messages, TOOLS if renders_tools else None)

    rendered = render(turn)
    if family.turn_start:
        turn = rendered.split(family.turn_start, 1)[1]
    else:
        prompt = render(ask).rstrip()  # the turn starts where this ends
        assert rendered.startswith(prompt), (prompt, rendered)
        turn = rendered[len(prompt) :]
    return turn.split(family.end_of_turn)[0]


def test_the_dialect_is_chosen_from_the_template(family: Family, tokenizer: Tokenizer) -> None:
    assert detect_format(tokenizer.chat_template) == family.dialect


def test_a_template_without_a_dialect_gets_hermes(smollm2_dir: Path) -> None:
    """SmolLM2's plain ChatML shows no dialect (densa then writes the tools into the prompt)."""
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    assert not tokenizer.template_renders_tools
    assert detect_format(tokenizer.chat_template) == "hermes"
    assert detect_format(None) == "hermes"


def test_calls_rendered_by_the_template_parse_back(family: Family, tokenizer: Tokenizer) -> None:
    fmt = tool_format(family.dialect).with_tools(TOOLS)
    turn, calls = assistant_turn(family, tokenizer), CALLS[: family.num_calls]
    parsed = parse_output(fmt, turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ], turn
    assert parsed.content.strip() in ("", "<think></think>"), parsed.content
    if family.dialect == "kimi_k2":  # Kimi's ids name the function; they are kept
        assert [c.call_id for c in parsed.tool_calls] == list(family.call_ids)
    if family.writes_like_template:  # (indentation some templates leave between calls aside)
        assert fmt.render_calls(calls).strip() in re.sub(" {2,}", "", turn)


@pytest.mark.parametrize("seed", range(5))
def test_any_split_of_the_stream_gives_the_whole_result(
    family: Family, tokenizer: Tokenizer, seed: int
) -> None:
    fmt = tool_format(family.dialect).with_tools(TOOLS)
    turn = assistant_turn(family, tokenizer)
    whole = parse_output(fmt, turn)
    rng, parser, events, start = random.Random(seed), ToolCallParser(fmt), [], 0
    while start < len(turn):
        end = start + rng.randint(1, 6)
        events += parser.feed(turn[start:end])
        start = end
    events += parser.finish()
    assert "".join(e.text for e in events if isinstance(e, Content)) == whole.content
    streamed: list[list[str]] = []
    for event in events:
        if isinstance(event, CallStart):
            streamed.append([event.name, ""])
        elif isinstance(event, CallArguments):
            streamed[event.index][1] += event.text
    assert streamed == [[c.name, c.arguments] for c in whole.tool_calls]


def test_a_forced_call_matches_the_marker_tokens(family: Family, tokenizer: Tokenizer) -> None:
    import llguidance.numpy as lln

    fmt = format_for(family.dialect, tokenizer.added_tokens)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    grammar = compiler.compile_now(fmt.call_grammar(TOOLS, parallel=True))

    def accepts(calls: list[dict[str, Any]]) -> bool:
        matcher = grammar.new_matcher()
        ids = tokenizer.encode(fmt.render_calls(calls), add_special_tokens=False)
        return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())

    if family.starts_with_marker:  # the first token allowed is that marker, as its token
        matcher = grammar.new_matcher()
        bitmask = lln.allocate_token_bitmask(1, tokenizer.vocab_size)
        lln.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: tokenizer.vocab_size]
        first = tokenizer.encode(fmt.render_calls(CALLS), add_special_tokens=False)[0]
        assert np.nonzero(bits)[0].tolist() == [first]
        assert first in fmt.tokens.values()

    assert accepts(CALLS)
    assert accepts(CALLS[:1])
    wrong_unit = {**CALLS[0], "arguments": {**CALLS[0]["arguments"], "unit": "kelvin"}}
    assert not accepts([wrong_unit])
    assert not accepts([{"name": "other", "arguments": {}}])
    no_city = {"name": "get_weather", "arguments": {"unit": "celsius"}}
    assert not accepts([no_city])
    compiler.shutdown()


def test_a_required_call_may_end_the_turn_after_each_call(
    family: Family, tokenizer: Tokenizer
) -> None:
    """tool_choice "required" with parallel calls: after each complete call, and after the
    newline a model writes there (Qwen2.5-Coder writes "</tool_call>\\n" then its end token),
    the end of the turn is allowed, so the model may stop instead of writing calls until
    max_tokens. The grammar stays closed: no text other than whitespace after the calls."""
    fmt = format_for(family.dialect, tokenizer.added_tokens)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    grammar = compiler.compile_now(fmt.call_grammar(TOOLS, parallel=True))
    for trailing in ("", "\n", "\n\n"):
        for num_calls in (1, 2):
            matcher = grammar.new_matcher()
            text = fmt.render_calls(CALLS[:num_calls]) + trailing
            assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
            assert matcher.is_accepting(), (num_calls, text)
        matcher = grammar.new_matcher()
        text = fmt.render_calls(CALLS[:1]) + trailing + "Done."
        assert not matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    compiler.shutdown()


def test_marker_tokens_that_are_special_reach_the_parser(smollm2_dir: Path) -> None:
    """Mistral's markers are special tokens, which a response's text leaves out: the plan keeps
    them in (the end-of-sequence token stays out), so the calls are read."""
    mistral = next(f for f in FAMILIES if f.dialect == "mistral")
    tokenizer = tokenizer_for(mistral, smollm2_dir)
    fmt = format_for("mistral", tokenizer.added_tokens)
    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    plan = plan_tools(fmt, tools, "required", None, None)
    token_ids = tokenizer.encode(fmt.render_calls(CALLS) + "</s>", add_special_tokens=False)

    def decoded(kept: tuple[int, ...]) -> str:
        detokenizer = Detokenizer(tokenizer, [], (), False, True, kept)
        for token_id in token_ids:
            detokenizer.add_token(token_id)
        return detokenizer.text

    assert parse_output(fmt, decoded(())).tool_calls == []  # the markers were dropped
    text = decoded(plan.marker_token_ids)
    assert "</s>" not in text
    calls = parse_output(fmt.with_tools(TOOLS), text).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["name"], c["arguments"]) for c in CALLS
    ]


EDGES = [
    ("glm", "Sure.\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>x y</arg_value>\n</tool_call>\n",
     "Sure.", [("f", '{"a": "x y"}')]),
    ("qwen3_coder", "<tool_call>\nnot a call\n</tool_call>", "<tool_call>\nnot a call\n</tool_call>", []),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": "x',
     "", [("f", '{"a": "x')]),  # cut short by max_tokens: the call keeps what it had
    ("deepseek_v3", 'ok <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": [1, "`"]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "ok", [("f", '{"a": [1, "`"]}')]),
    ("mistral", 'Hi[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "Hi",
     [("f", '{"a": 1}'), ("g", "{}")]),
    # The text ends inside a block: markup cut short (by max_tokens), never content.
    ("mistral_json", "[TOOL_CALLS] [not json", "", []),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "', "Let me check.", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<funct", "Sure.", []),
    # Bare calls (llama3_json) cut before the name: not content either.
    ("llama3_json", '{"name": "get_weather", "para', "", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g', "", [("f", '{"a": 1}')]),
    # Cut inside a value: the call keeps its arguments unclosed, never passes as complete.
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=f>\n<parameter=a>\n1", "Sure.", [("f", "{")]),
    ("glm", "Sure.<tool_call>f\n<arg_key>a</arg_key>\n<arg_val", "Sure.", [("f", "{")]),
    # A closed block that is no call stays content, byte for byte.
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
]  # fmt: skip


@pytest.mark.parametrize(("dialect", "text", "content", "calls"), EDGES)
def test_content_broken_blocks_and_cut_calls(
    dialect: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    parsed = parse_output(tool_format(dialect), text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


def test_values_written_as_text_are_typed_by_the_schema() -> None:
    glm = tool_format("glm")
    text = "<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n</tool_call>"  # fmt: skip
    assert parse_output(glm, text).tool_calls[0].arguments == '{"code": "007", "n": 7}'
    schema = {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "string"}}}
    typed = glm.with_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert parse_output(typed, text).tool_calls[0].arguments == '{"code": "007", "n": "7"}'
