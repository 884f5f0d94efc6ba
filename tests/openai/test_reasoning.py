"""The reasoning split (openai/reasoning.py): every format, every place the answer may start, and
every way the text may be cut into outputs -- no piece of a marker ever reaches either field."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from densa.openai.reasoning import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningSplitter,
    ReasoningStart,
    Split,
    reasoning_format,
)
from densa.text.tokenizer import Tokenizer

R1 = REASONING_FORMATS["deepseek_r1"]
QWEN3 = REASONING_FORMATS["qwen3"]
KIMI = REASONING_FORMATS["kimi_k2"]
GLM = REASONING_FORMATS["glm45"]
KIMI_SECTION = "<|tool_calls_section_begin|>"

# (format, where the answer starts, the answer, expected reasoning, expected content)
CASES = [
    (QWEN3, ReasoningStart.AWAIT_START, "<think>\nSea is salty.\n</think>\n\nIt is salty.",
     "Sea is salty.", "It is salty."),
    (QWEN3, ReasoningStart.AWAIT_START, "  No thinking < here.", "", "  No thinking < here."),
    (GLM, ReasoningStart.AWAIT_START, "<think></think>Just this.", "", "Just this."),
    (GLM, ReasoningStart.AWAIT_START, "<thin>k</think>", "", "<thin>k</think>"),
    (R1, ReasoningStart.REASONING, "Okay, a < b and </thi is not the end.</think>Yes.",
     "Okay, a < b and </thi is not the end.", "Yes."),
    (R1, ReasoningStart.REASONING, "<think>\nHmm.</think>\n\nDone.", "Hmm.", "Done."),
    (R1, ReasoningStart.REASONING, "cut short </thi", "cut short </thi", ""),
    (R1, ReasoningStart.CONTENT, "<think>x</think> y", "", "<think>x</think> y"),
    (KIMI, ReasoningStart.REASONING, f"Call it.{KIMI_SECTION}<|tool_call_begin|>",
     "Call it.", f"{KIMI_SECTION}<|tool_call_begin|>"),
    (KIMI, ReasoningStart.REASONING, "<think>A</think>B</think>", "A", "B</think>"),
]  # fmt: skip


def feed_pieces(fmt: ReasoningFormat, start: ReasoningStart, pieces: list[str]) -> list[Split]:
    splitter = ReasoningSplitter(fmt, start)
    splits = [splitter.feed(piece) for piece in pieces]
    return [*splits, splitter.finish()]


def joined(splits: list[Split]) -> Split:
    return Split("".join(s.reasoning for s in splits), "".join(s.content for s in splits))


@pytest.mark.parametrize(("fmt", "start", "text", "reasoning", "content"), CASES)
def test_whole_answers_split(
    fmt: ReasoningFormat, start: ReasoningStart, text: str, reasoning: str, content: str
) -> None:
    assert ReasoningSplitter(fmt, start).split_all(text) == Split(reasoning, content)


@pytest.mark.parametrize(("fmt", "start", "text", "reasoning", "content"), CASES)
def test_every_cut_of_the_text_gives_the_same_split(
    fmt: ReasoningFormat, start: ReasoningStart, text: str, reasoning: str, content: str
) -> None:
    """Cut anywhere, twice (through any marker), or char by char: the pieces join to exactly the
    whole split, so no part of a marker leaked into a field; reasoning never follows content."""
    expected = Split(reasoning, content)
    ends = itertools.combinations(range(len(text) + 1), 2)
    cuts = [[text[:i], text[i:j], text[j:]] for i, j in ends]
    for pieces in [*cuts, list(text)]:
        splits = feed_pieces(fmt, start, pieces)
        assert joined(splits) == expected, pieces
        first_content = next((i for i, s in enumerate(splits) if s.content), len(splits))
        assert not any(s.reasoning for s in splits[first_content + 1 :]), pieces


def test_text_is_released_as_soon_as_it_is_decided() -> None:
    splitter = ReasoningSplitter(R1, ReasoningStart.REASONING)
    assert splitter.feed("I think") == Split("I think", "")
    assert splitter.feed(" so <") == Split(" so", "")  # " <" may begin </think>
    assert splitter.feed("b") == Split(" <b", "")
    assert splitter.feed("\n</") == Split("", "")
    assert splitter.feed("think>") == Split("", "")  # the space after it is not content yet
    assert splitter.feed("\n\nAnswer") == Split("", "Answer")
    assert splitter.feed(" </think>") == Split("", " </think>")  # content is never re-read


PROMPT_ENDS = [
    (R1, "<|Assistant|><think>\n", ReasoningStart.REASONING),  # R1's template opened it
    (R1, "<|Assistant|>", ReasoningStart.REASONING),  # R1 reasons without writing <think>
    (QWEN3, "<|im_start|>assistant\n<think>\n", ReasoningStart.REASONING),
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", ReasoningStart.CONTENT),
    (QWEN3, "<|im_start|>assistant\n", ReasoningStart.AWAIT_START),
    (GLM, "<|assistant|>\n<think></think>", ReasoningStart.CONTENT),
    (GLM, "<|assistant|>", ReasoningStart.AWAIT_START),
    (KIMI, "<|im_assistant|>assistant<|im_middle|>", ReasoningStart.REASONING),
]


@pytest.mark.parametrize(("fmt", "tail", "start"), PROMPT_ENDS)
def test_where_the_answer_starts_is_read_from_the_prompt(
    fmt: ReasoningFormat, tail: str, start: ReasoningStart
) -> None:
    assert fmt.first_state(tail) is start


def test_the_thinking_switch_turns_reasoning_off() -> None:
    assert QWEN3.first_state("assistant\n", {"enable_thinking": False}) is ReasoningStart.CONTENT
    assert QWEN3.first_state("assistant\n", {"enable_thinking": True}) is ReasoningStart.AWAIT_START
    assert KIMI.first_state("<|im_middle|>", {"thinking": False}) is ReasoningStart.CONTENT
    assert R1.first_state("<|Assistant|>", {"enable_thinking": False}) is ReasoningStart.REASONING


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, glm45, harmony, kimi_k2, qwen3"):
        reasoning_format("o1")


def test_special_token_markers_survive_decoding(smollm2_dir: Path) -> None:
    """Where a marker is a special token, decoding that skips special tokens keeps it (only it),
    so the split can see it."""
    plain = Tokenizer.from_dir(smollm2_dir)
    shown = Tokenizer(plain.files, (), shown_special_tokens=("<|im_start|>",))
    ids = plain.encode("<|im_start|>think<|im_end|>", add_special_tokens=False)
    assert plain.decode(ids) == "think"
    assert shown.decode(ids) == "<|im_start|>think"
    assert shown.decode(ids, skip_special_tokens=False) == "<|im_start|>think<|im_end|>"
