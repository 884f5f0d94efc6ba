"""Reads tool calls out of generated text as it arrives, in the dialect's own way.

`ToolCallParser(fmt)` is one response's parser (the dialect's `new_parser`); `parse_output` runs
one over a whole text, which is what a non-streamed response returns. Events: events.py.
"""

from __future__ import annotations

from densa.openai.tools.base import ToolCallFormat
from densa.openai.tools.events import (
    CallArguments,
    CallStart,
    Content,
    Event,
    ParsedOutput,
    ToolCall,
    new_call_id,
)

__all__ = ["CallArguments", "CallStart", "Content", "Event", "ParsedOutput", "ToolCall",
           "ToolCallParser", "new_call_id", "parse_output"]  # fmt: skip


class ToolCallParser:
    """The parser of one response in `fmt`'s dialect."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._parser = fmt.new_parser()

    @property
    def calls(self) -> list[ToolCall]:
        return self._parser.calls

    def feed(self, text: str) -> list[Event]:
        return self._parser.feed(text)

    def finish(self) -> list[Event]:
        return self._parser.finish()


def parse_output(fmt: ToolCallFormat, text: str) -> ParsedOutput:
    """The whole text at once: content and calls (what a non-streamed response returns)."""
    parser = fmt.new_parser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return ParsedOutput(content, parser.calls)
