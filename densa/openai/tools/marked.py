"""The parser shared by dialects that wrap calls in markers (Kimi K2, DeepSeek, GLM, Qwen3-Coder,
Mistral): it finds the markers; each dialect's `CallReader` reads what one call block says.

    content  <section_open>  <call_open> body <call_close>  ...  <section_close>  content

A dialect without sections starts each call with `call_open` right in the content; one without
`call_close` ends a call where the next one or the section begins, or where the text ends. Text
that may still become a marker is held back. While a block is open its reader is asked again
as text arrives, and the call's arguments stream as they grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from densa.openai.tools.events import (
    CallArguments,
    CallStart,
    Content,
    Event,
    ToolCall,
    new_call_id,
)
from densa.openai.tools.json_calls import partial_suffix


@dataclass(frozen=True)
class Markers:
    call_open: str
    call_close: str = ""  # "" = a call ends where the next call, the section or the text ends
    section_open: str = ""  # "" = calls stand alone in the content
    section_close: str = ""


@dataclass(frozen=True)
class CallRead:
    name: str
    arguments: str  # JSON text; while streaming, a prefix of what it will finally be
    call_id: str | None = None  # the model's own id for the call, if it writes one


class CallReader(Protocol):
    def read(self, body: str, final: bool) -> list[CallRead] | None:
        """The calls in one block's text. While streaming (`final` False): at most one, once its
        name is known, its arguments only ever growing. None: not (or not yet) a call."""
        ...


_CONTENT, _SECTION, _CALL = "content", "section", "call"


class MarkedCallParser:
    def __init__(self, markers: Markers, reader: CallReader) -> None:
        self.markers = markers
        self.reader = reader
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet turned into events (in a call: the block so far)
        self._mode = _CONTENT
        self._in_section = False
        self._block_started = False  # a call of the open block has been announced
        self._searched = 0  # the open block holds no end marker before this (no search again)

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        steps = {_CONTENT: self._content, _SECTION: self._section, _CALL: self._call}
        while self._pending:
            before = (self._mode, len(self._pending))
            steps[self._mode](events)
            if (self._mode, len(self._pending)) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._mode == _CONTENT and (self._pending.strip() or not self.calls):
            _emit(events, self._pending)  # (whitespace after the calls is not an answer)
        elif self._mode == _CALL:  # a block the text ended in: a call, or markup cut short
            self._complete(events, self._pending, cut=True)
        self._pending, self._mode = "", _CONTENT
        return events

    # ---- modes ---------------------------------------------------------------------------------
    def _content(self, events: list[Event]) -> None:
        m = self.markers
        found = _first(self._pending, [m.section_open, m.call_open])
        if found is not None:
            idx, marker = found
            _emit(events, self._pending[:idx].rstrip())
            self._pending = self._pending[idx + len(marker) :]
            self._in_section = marker == m.section_open
            self._mode = _SECTION if self._in_section else _CALL
            return
        # Hold back what may begin a marker, and trailing whitespace (it may precede one).
        text = self._pending
        held = max(partial_suffix(text, marker) for marker in (m.section_open, m.call_open))
        keep = len(text) - len(text[: len(text) - held].rstrip())
        _emit(events, text[: len(text) - keep])
        self._pending = text[len(text) - keep :]

    def _section(self, events: list[Event]) -> None:
        m = self.markers
        found = _first(self._pending, [m.call_open, m.section_close])
        if found is None:  # only whitespace is expected here: drop the rest, keep a partial
            held = max(partial_suffix(self._pending, x) for x in (m.call_open, m.section_close))
            self._pending = self._pending[len(self._pending) - held :]
            return
        idx, marker = found
        self._pending = self._pending[idx + len(marker) :]
        self._mode = _CALL if marker == m.call_open else _CONTENT

    def _call(self, events: list[Event]) -> None:
        m = self.markers
        ends = [m.call_close] if m.call_close else [m.call_open, m.section_close]
        found = _first(self._pending, ends, self._searched)
        if found is None:
            self._searched = max(0, len(self._pending) - max(len(end) for end in ends) + 1)
            held = max(partial_suffix(self._pending, end) for end in ends)
            reads = self.reader.read(self._pending[: len(self._pending) - held], final=False)
            if reads:
                self._advance(events, reads[0])
            return
        idx, marker = found
        body = self._pending[:idx]
        self._pending = self._pending[idx + len(marker) if marker == m.call_close else idx :]
        self._complete(events, body)
        self._mode = _SECTION if self._in_section else _CONTENT
        self._searched = 0

    # ---- calls ---------------------------------------------------------------------------------
    def _complete(self, events: list[Event], body: str, cut: bool = False) -> None:
        """The calls of a block that ended (`cut`: the text ended inside it). A closed block that
        is no call is content, byte for byte; an unclosed one is markup cut short (by max_tokens
        or the model's end), never returned as an answer: its call keeps the arguments streamed
        so far, unclosed, as a cut JSON call does (read as final, a call cut inside a value would
        pass as complete with that value missing)."""
        # Without a close marker a call ends where the text does: the end completes it.
        reads = self.reader.read(body, final=not cut or not self.markers.call_close)
        if reads is None and not self._block_started and not cut:
            m = self.markers
            _emit(events, m.call_open + body + m.call_close)
        for idx, read in enumerate(reads or []):
            if idx > 0:
                self._block_started = False
            self._advance(events, read)
        self._block_started = False

    def _advance(self, events: list[Event], read: CallRead) -> None:
        if not self._block_started:
            call = ToolCall(read.call_id or new_call_id(), read.name, "")
            self.calls.append(call)
            events.append(CallStart(len(self.calls) - 1, call.call_id, call.name))
            self._block_started = True
        call = self.calls[-1]
        if len(read.arguments) > len(call.arguments) and read.arguments.startswith(call.arguments):
            fragment = read.arguments[len(call.arguments) :]
            call.arguments = read.arguments
            events.append(CallArguments(len(self.calls) - 1, fragment))


def _first(text: str, markers: list[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest of `markers` in text[start:] (empty ones never match)."""
    hits = [(at, m) for m in markers if m and (at := text.find(m, start)) >= 0]
    return min(hits) if hits else None


def _emit(events: list[Event], text: str) -> None:
    if text:
        events.append(Content(text))
