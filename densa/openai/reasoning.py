"""A reasoning model's answer, split into its reasoning and its content (`--reasoning-parser`).

Reasoning models think between markers before they answer: `<think>` ... `</think>` for
DeepSeek R1, Qwen3, Kimi K2 and GLM 4.5. The split returns the thinking as `reasoning_content`
and the rest as `content` (where tool calls are then looked for), streamed the same way: a marker
split across tokens or outputs is held back until it is decided, so no part of one ever reaches
either field.

    state           what the answer's text is              how it ends
    AWAIT_START     undecided: whitespace, a start prefix   a start marker -> REASONING,
                                                            anything else -> CONTENT
    REASONING       reasoning                               the end marker (dropped), or one of
                                                            the format's content markers (kept)
    CONTENT         content                                 never

Where the answer starts is read from the end of the prompt, because templates differ: one that
opens `<think>` in the prompt (DeepSeek R1, Qwen3 thinking models) starts the answer in
REASONING; one that closes an empty `<think></think>` there (Qwen3 / GLM with
`enable_thinking: false`) starts it in CONTENT. Otherwise the format says: R1 and Kimi K2 may
reason without writing a start marker (REASONING), Qwen3 and GLM write one if they think at all
(AWAIT_START). Whitespace around the reasoning (`<think>\\n...\\n</think>\\n\\n`) belongs to
neither field.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from densa.openai import harmony
from densa.text.tokenizer import Tokenizer

PROMPT_TAIL_TOKENS = 16  # prompt tokens read for a marker the template left at its end


class ReasoningStart(enum.Enum):
    AWAIT_START = "await_start"
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # The model may reason without writing `start` first (DeepSeek R1's original template
    # opened it in the prompt, and the model never writes it).
    starts_in_reasoning: bool = False
    # Markers that end reasoning without `end` and belong to the content: Kimi K2 may open its
    # tool-call section straight from its reasoning.
    content_markers: tuple[str, ...] = ()
    # The chat_template_kwargs switch that turns thinking off when false.
    thinking_switch: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker the split reads (decoding must keep them, special tokens or not)."""
        return (self.start, self.end, *self.content_markers)

    def first_state(
        self, prompt_tail: str, template_kwargs: Mapping[str, Any] | None = None
    ) -> ReasoningStart:
        """Where an answer to a prompt ending in `prompt_tail` starts (see the module doc)."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.start):
            return ReasoningStart.REASONING
        if tail.endswith(self.end):
            return ReasoningStart.CONTENT
        if self.thinking_switch and (template_kwargs or {}).get(self.thinking_switch) is False:
            return ReasoningStart.CONTENT
        return ReasoningStart.REASONING if self.starts_in_reasoning else ReasoningStart.AWAIT_START

    def splitter(
        self, tokenizer: Tokenizer, prompt_ids: list[int], template_kwargs: Mapping[str, Any]
    ) -> ReasoningSplitter:
        """The split for one answer to `prompt_ids`."""
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return ReasoningSplitter(self, self.first_state(tail, template_kwargs))


@dataclass(frozen=True)
class HarmonyReasoningFormat(ReasoningFormat):
    """gpt-oss's harmony messages (densa.openai.harmony): the analysis channel is reasoning,
    the final channel and preambles content, calls handed on as the `harmony` dialect's
    blocks. The split follows the messages' headers, not one start / end pair."""

    @property
    def markers(self) -> tuple[str, ...]:
        return harmony.MARKERS

    def splitter(
        self, tokenizer: Tokenizer, prompt_ids: list[int], template_kwargs: Mapping[str, Any]
    ) -> ReasoningSplitter:
        return HarmonySplitter(self)


REASONING_FORMATS = {
    fmt.name: fmt
    for fmt in (
        ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
        ReasoningFormat("qwen3", thinking_switch="enable_thinking"),
        ReasoningFormat(
            "kimi_k2",
            starts_in_reasoning=True,
            content_markers=("<|tool_calls_section_begin|>",),
            thinking_switch="thinking",
        ),
        ReasoningFormat("glm45", thinking_switch="enable_thinking"),
        HarmonyReasoningFormat("harmony"),
    )
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The registered format; ValueError listing the known ones."""
    fmt = REASONING_FORMATS.get(name)
    if fmt is None:
        known = ", ".join(sorted(REASONING_FORMATS))
        raise ValueError(f"--reasoning-parser {name!r} is unknown; choose one of {known}")
    return fmt


class Split(NamedTuple):
    reasoning: str
    content: str


class ReasoningSplitter:
    """One answer's split, fed its text in order. Within one feed reasoning always comes before
    content (the state only moves forward), so each feed returns one `Split`."""

    def __init__(self, fmt: ReasoningFormat, start: ReasoningStart) -> None:
        self.fmt = fmt
        self._state = start
        self._pending = ""  # text not yet handed out: a possible marker, or undecided whitespace
        self._reasoning_started = False  # reasoning text was handed out (no more leading space)
        self._content_started = False

    def feed(self, text: str, final: bool = False) -> Split:
        """The reasoning and content `text` completes; `final`: the answer ends here."""
        self._pending += text
        if self._state is ReasoningStart.AWAIT_START:
            self._await_start(final)
        reasoning = self._take_reasoning(final) if self._state is ReasoningStart.REASONING else ""
        content = self._take_content() if self._state is ReasoningStart.CONTENT else ""
        return Split(reasoning, content)

    def finish(self) -> Split:
        return self.feed("", final=True)

    def drop_calls(self) -> None:
        """The request parses no tool calls. Formats whose calls are the model's own text in
        the content leave them there (as without a reasoning parser); harmony overrides it."""

    def split_all(self, text: str) -> Split:
        """A whole answer at once (what a non-streamed response returns)."""
        return self.feed(text, final=True)

    def _await_start(self, final: bool) -> None:
        head = self._pending.lstrip()
        if head.startswith(self.fmt.start):
            self._pending = head[len(self.fmt.start) :]
            self._state = ReasoningStart.REASONING
        elif final or not self.fmt.start.startswith(head):
            self._state = ReasoningStart.CONTENT  # the text is content, leading space and all
            self._content_started = True

    def _take_reasoning(self, final: bool) -> str:
        if not self._reasoning_started and not self._skip_leading_start(final):
            return ""
        cut, marker = _first_marker(self._pending, (self.fmt.end, *self.fmt.content_markers))
        if marker is not None:
            reasoning = self._pending[:cut].rstrip()
            kept = cut if marker != self.fmt.end else cut + len(marker)
            self._pending = self._pending[kept:]
            self._state = ReasoningStart.CONTENT
            self._content_started = marker != self.fmt.end
        elif final:
            reasoning, self._pending = self._pending.rstrip(), ""
        else:
            held = _undecided_tail(self._pending, (self.fmt.end, *self.fmt.content_markers))
            reasoning, self._pending = self._pending[:held], self._pending[held:]
        self._reasoning_started = self._reasoning_started or bool(reasoning)
        return reasoning

    def _skip_leading_start(self, final: bool) -> bool:
        """Before any reasoning text: drop leading whitespace and a start marker the model wrote
        anyway. False while what has come may still be the marker."""
        head = self._pending.lstrip()
        while head.startswith(self.fmt.start):
            head = head[len(self.fmt.start) :].lstrip()
        self._pending = head
        return final or (bool(head) and not self.fmt.start.startswith(head))

    def _take_content(self) -> str:
        content, self._pending = self._pending, ""
        if not self._content_started:  # the space after the end marker belongs to neither
            content = content.lstrip()
            self._content_started = bool(content)
        return content


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest of `markers` in `text`: (its index, the marker), or (-1, None)."""
    hits = [(text.find(marker), marker) for marker in markers]
    found = [(idx, marker) for idx, marker in hits if idx >= 0]
    return min(found) if found else (-1, None)


def _undecided_tail(text: str, markers: tuple[str, ...]) -> int:
    """Where the held-back tail of `text` starts: its trailing whitespace and the longest end of
    it that begins a marker -- both may yet turn out to border a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return len(text[: len(text) - longest].rstrip())


class HarmonySplitter(ReasoningSplitter):
    """The harmony split (densa.openai.harmony.HarmonyStream) behind ReasoningSplitter's
    interface."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        super().__init__(fmt, ReasoningStart.AWAIT_START)
        self._stream = harmony.HarmonyStream()

    def feed(self, text: str, final: bool = False) -> Split:
        return Split(*self._stream.feed(text, final))

    def drop_calls(self) -> None:
        """Call messages are densa's canonical blocks, not the model's text: without a tool
        parser to read them they are dropped, never content."""
        self._stream = harmony.HarmonyStream(keep_calls=False)
