"""Generated text as an ordered list of content blocks: text, and tool calls read out of it.

Anthropic Messages answers with content blocks (`thinking`, `text`, `tool_use`) and OpenAI
Responses with output items (`reasoning`, `message`, `function_call`); both are this one sequence,
formatted differently. `BlockStream` turns a request's text deltas into block events as the
reasoning split (openai/reasoning.py, with `--reasoning-parser`) and the tool-call parser
(openai/tools/parser.py) find them:

    BlockStart(index, kind, call_id, name)   a block begins ("reasoning" -- always the first,
                                             "text", or "call" with its name)
    BlockDelta(index, text)                  the next text, or the next arguments-JSON fragment
    BlockStop(index)                         the block is complete

One block is open at a time; it closes when the next one starts or the text ends. A whole
answer is the same stream run over the whole text (`whole_blocks`), so a streamed answer always
reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from densa.openai.reasoning import ReasoningSplitter
from densa.openai.tools.formats import ToolCallFormat
from densa.openai.tools.parser import CallArguments, CallStart, Content, Event, ToolCallParser

BlockKind = Literal["reasoning", "text", "call"]


@dataclass(frozen=True)
class BlockStart:
    index: int
    kind: BlockKind
    call_id: str = ""  # a call's id (the parser's `call_...`)
    name: str = ""  # a call's function name


@dataclass(frozen=True)
class BlockDelta:
    index: int
    text: str


@dataclass(frozen=True)
class BlockStop:
    index: int


BlockEvent = BlockStart | BlockDelta | BlockStop


@dataclass
class Block:
    """A complete block: its text, or a call's arguments JSON (as the model wrote it)."""

    kind: BlockKind
    text: str = ""
    call_id: str = ""
    name: str = ""


class BlockStream:
    """One response's blocks. Without a tool format (no tools offered) all content is one text
    block; without a reasoning split there is no reasoning block."""

    def __init__(
        self, tool_format: ToolCallFormat | None, reasoning: ReasoningSplitter | None = None
    ) -> None:
        self._parser = ToolCallParser(tool_format) if tool_format is not None else None
        self._reasoning = reasoning
        self._open: Block | None = None
        self.num_blocks = 0
        self.num_calls = 0

    def feed(self, text: str, finished: bool = False) -> list[BlockEvent]:
        """Events for the next text; `finished` releases held-back text, closes the last block."""
        events: list[BlockEvent] = []
        if self._reasoning is not None:
            # The split comes first: calls and text are read from the content only.
            split = self._reasoning.feed(text, final=finished)
            events += self._reasoning_events(split.reasoning)
            text = split.content
        for event in self._parse(text, finished):
            events += self._block_events(event)
        if finished and self._open is not None:
            events.append(BlockStop(self.num_blocks - 1))
            self._open = None
        return events

    def _parse(self, text: str, finished: bool) -> list[Event]:
        if self._parser is None:
            return [Content(text)] if text else []
        return self._parser.feed(text) + (self._parser.finish() if finished else [])

    def _reasoning_events(self, reasoning: str) -> list[BlockEvent]:
        if not reasoning:
            return []
        events: list[BlockEvent] = []
        if self._open is None or self._open.kind != "reasoning":
            events += self._start(Block("reasoning"))
        assert self._open is not None
        self._open.text += reasoning
        return [*events, BlockDelta(self.num_blocks - 1, reasoning)]

    def _block_events(self, event: Event) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if isinstance(event, CallStart):
            events += self._start(Block("call", call_id=event.call_id, name=event.name))
            self.num_calls += 1
        elif isinstance(event, Content) and (self._open is None or self._open.kind != "text"):
            events += self._start(Block("text"))
        text = event.text if isinstance(event, Content | CallArguments) else ""
        if text:
            assert self._open is not None
            self._open.text += text
            events.append(BlockDelta(self.num_blocks - 1, text))
        return events

    def _start(self, block: Block) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is not None:
            events.append(BlockStop(self.num_blocks - 1))
        self._open = block
        self.num_blocks += 1
        events.append(BlockStart(self.num_blocks - 1, block.kind, block.call_id, block.name))
        return events


def whole_blocks(
    tool_format: ToolCallFormat | None, text: str, reasoning: ReasoningSplitter | None = None
) -> list[Block]:
    """The blocks of a whole answer: what a stream of it would have built."""
    blocks: list[Block] = []
    for event in BlockStream(tool_format, reasoning).feed(text, finished=True):
        if isinstance(event, BlockStart):
            blocks.append(Block(event.kind, call_id=event.call_id, name=event.name))
        elif isinstance(event, BlockDelta):
            blocks[event.index].text += event.text
    return blocks
