"""What a call parser reports as text arrives, in the shape OpenAI streams calls.

    Content(text)                  text outside any call (a possible marker prefix is held back)
    CallStart(index, id, name)     a call's name is known
    CallArguments(index, text)     the next fragment of its arguments JSON

Every dialect's parser (`ToolCallFormat.new_parser`) speaks these. A non-streamed response runs
the same parser over the whole text, so streamed deltas always reassemble to exactly the
non-streamed result.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


class CallParser(Protocol):
    """One response's parser: fed its text in pieces, then finished once."""

    calls: list[ToolCall]  # the calls read so far (arguments as streamed)

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]:
        """The end of the text: release held-back text; a call cut short keeps what it had."""
        ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
