"""gpt-oss's harmony format: answers split into reasoning_content (the analysis channel), content
(final, preambles) and tool_calls (commentary to=functions.NAME), streamed piece by piece to the
same result as at once, whichever header layout the model writes and whether or not the end
tokens (<|call|>, <|return|>) reach the text; and densa's harmony chat template.

No tokenizer of gpt-oss ships in an installable package here (o200k_harmony's ranks ship only
inside unrelated tokenizer packages), so the tokenizer test builds one from SmolLM2's with the
harmony markers added as special tokens: it checks that they are single tokens that decoding
keeps, not o200k's own ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from densa.openai import harmony
from densa.openai.reasoning import HarmonySplitter, reasoning_format
from densa.openai.tools.events import CallArguments, CallStart, Content
from densa.openai.tools.formats import detect_format, tool_format
from densa.text.tokenizer import Tokenizer

TEMPLATE = (Path(harmony.__file__).parent / "chat_templates" / "harmony.jinja").read_text()
CALL = (
    "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
CALL_IN_ROLE = (  # the recipient in the role part, the end token not in the text
    "<|channel|>analysis<|message|>Look it up.<|end|>"
    '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 12}'
)
FINAL = (
    "<|channel|>analysis<|message|>2 + 2 = 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
)
PREAMBLE = (
    "<|channel|>commentary<|message|>Checking the forecast.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}'
)


def _split(text: str, pieces: int) -> tuple[str, str]:
    splitter = HarmonySplitter(reasoning_format("harmony"))
    size = max(1, len(text) // pieces)
    parts = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)]
    parts.append(splitter.finish())
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


def _calls(content: str) -> tuple[str, list[tuple[str, str]]]:
    parser = tool_format("harmony").new_parser()
    events = []
    for ch in content:  # streamed as finely as it gets
        events += parser.feed(ch)
    events += parser.finish()
    text = "".join(e.text for e in events if isinstance(e, Content))
    starts = [e.name for e in events if isinstance(e, CallStart)]
    arguments = ["".join(a.text for a in events if isinstance(a, CallArguments) and a.index == i)
                 for i in range(len(starts))]  # fmt: skip
    return text, list(zip(starts, arguments, strict=True))


@pytest.mark.parametrize(
    ("answer", "reasoning", "content", "calls"),
    [
        (CALL, "The user wants the weather; call the tool.", "",
         [("get_weather", '{"city": "Paris"}')]),
        (CALL_IN_ROLE, "Look it up.", "", [("lookup", '{"q": 12}')]),
        (FINAL, "2 + 2 = 4.", "The answer is 4.", []),
        (PREAMBLE, "", "Checking the forecast.", [("get_weather", '{"city": "Oslo"}')]),
        ("Plain text, no header.", "", "Plain text, no header.", []),
    ],
)  # fmt: skip
def test_channels_split_into_reasoning_content_and_calls(
    answer: str, reasoning: str, content: str, calls: list[tuple[str, str]]
) -> None:
    whole = _split(answer, 1)
    assert whole[0] == reasoning
    for pieces in (3, 17, len(answer)):  # streamed: the same, whatever the pieces
        assert _split(answer, pieces) == whole
    text, found = _calls(whole[1])
    assert text == content and found == calls


@pytest.mark.parametrize(
    ("answer", "reasoning", "content", "calls"),
    [
        # no <|end|>: the next header closes the message, it is not reasoning text
        ("<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>answer",
         "think", "answer", []),
        ("<|channel|>final<|message|>one<|channel|>final<|message|> two", "", "one two", []),
        # stray markers between and inside messages are dropped, never content
        ("<|message|>lost<|end|><|channel|>final<|message|>ok<|constrain|><|return|>",
         "", "lostok", []),
        # a recipient that is not one of the request's functions: neither content nor a call
        ("<|channel|>commentary to=browser.search<|message|>{\"q\": 1}<|call|>", "", "", []),
        ("<|channel|>commentary to=<|constrain|>json<|message|>{}<|call|>", "", "", []),
        ("<|channel|>commentary to= <|constrain|>json<|message|>{}<|call|>", "", "", []),
    ],
)  # fmt: skip
def test_malformed_answers_never_put_markup_in_content_or_crash(
    answer: str, reasoning: str, content: str, calls: list[tuple[str, str]]
) -> None:
    whole = _split(answer, 1)
    assert whole[0] == reasoning
    for pieces in (3, 17, len(answer)):
        assert _split(answer, pieces) == whole
    text, found = _calls(whole[1])
    assert (text, found) == (content, calls)
    assert not any(marker in text + whole[0] for marker in harmony.MARKERS)


def test_a_call_without_a_tool_parser_is_dropped_not_content() -> None:
    splitter = HarmonySplitter(reasoning_format("harmony"))
    splitter.drop_calls()  # the request offers no tools
    assert splitter.split_all(PREAMBLE).content == "Checking the forecast."


@pytest.mark.parametrize("head", ["to=<|constrain|>json", "to= <|constrain|>json", "to=x.y"])
def test_the_raw_text_reader_takes_only_function_recipients(head: str) -> None:
    _, found = _calls(f"<|channel|>commentary {head}<|message|>{{}}<|call|>")
    assert found == []


def test_without_the_reasoning_parser_calls_are_read_from_the_raw_text() -> None:
    text, found = _calls(CALL)
    assert found == [("get_weather", '{"city": "Paris"}')]
    assert "analysis" in text  # what the model wrote around the call is left as it was


def test_the_calls_render_as_the_model_writes_them() -> None:
    rendered = tool_format("harmony").render_calls([{"name": "f", "arguments": {"a": 1}}])
    assert rendered == (
        '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
        "<|call|>"
    )
    _, found = _calls(HarmonySplitter(reasoning_format("harmony")).split_all(rendered).content)
    assert found == [("f", '{"a": 1}')]


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Tokenizer:
    """SmolLM2's BPE with harmony's markers as special tokens, and densa's harmony template."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer

    out = tmp_path_factory.mktemp("harmony-tokenizer")
    rust = RustTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    rust.add_special_tokens([AddedToken(m, special=True) for m in harmony.MARKERS])
    rust.save(str(out / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|return|>", "bos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(out)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}]  # fmt: skip


def test_the_template_renders_harmony(harmony_tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": '{"t": 21}'},
    ]  # fmt: skip
    prompt = harmony_tokenizer.render_chat(messages, tools=TOOLS)
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in prompt
    assert (
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// The weather in a city.\ntype get_weather = (_: {\n"
        '// The city.\ncity: string,\nunit?: "c" | "f",\n}) => any;\n\n} // namespace functions'
        "<|end|>"
    ) in prompt
    assert prompt.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>{"t": 21}<|end|><|start|>assistant'
    )
    assert detect_format(harmony_tokenizer.chat_template) == "harmony"


def test_a_tool_result_takes_its_function_from_the_call_it_answers(
    harmony_tokenizer: Tokenizer,
) -> None:
    """OpenAI clients send a tool result's tool_call_id only; a preamble beside calls is
    commentary, as gpt-oss writes it."""
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time",
                                                          "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    prompt = harmony_tokenizer.render_chat(messages, tools=TOOLS)
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>" in prompt
    assert prompt.endswith(
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>12:00<|end|>"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant"
    )
    from densa.text.tokenizer import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="tool_call_id"):
        unanswered = {"role": "tool", "tool_call_id": "c9", "content": "?"}
        harmony_tokenizer.render_chat([*messages[:2], unanswered], tools=TOOLS)


def test_markers_are_single_tokens_that_decoding_keeps(harmony_tokenizer: Tokenizer) -> None:
    ids = harmony_tokenizer.encode(FINAL)
    added = harmony_tokenizer.added_tokens
    for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"):
        assert added[marker] in ids
    shown = Tokenizer(harmony_tokenizer.files, (), shown_special_tokens=harmony.MARKERS)
    assert shown.decode(ids) == FINAL
