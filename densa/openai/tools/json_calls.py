"""Dialects whose calls are JSON objects naming the function: Hermes and Llama 3 JSON.

hermes (Hermes / Qwen2.5 style), one call per block, blocks back to back:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

llama3_json (Llama 3.x): the answer is the call itself, several separated by "; ":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

The parser streams a call's arguments while it is written when the call begins with its name
(`{"name": ..., "arguments": ...}`, always so under a constraint); otherwise the call is read
whole once it closes. A block that is not a call stays content, byte for byte.

Fenced calls (hermes only). Small Qwen2.5 models, asked with tools but not constrained, often
write the call as a Markdown JSON block instead of between the <tool_call> tokens:

    ```json
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ```

(Qwen2.5-Coder-1.5B does so for every BFCL case: 0% valid calls before this was read.) Such a
block is a call only when the request offered tools, it names one of them and its arguments are
an object; anything else, a JSON example in an answer included, stays content. llama.cpp's
server reads these blocks too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from densa.openai.tools.base import (
    Schemas,
    ToolCallFormat,
    json_rule,
    parameters,
    repeat,
    start_rule,
)
from densa.openai.tools.events import (
    CallArguments,
    CallParser,
    CallStart,
    Content,
    Event,
    ToolCall,
    new_call_id,
)
from densa.openai.tools.lark import seq
from densa.sampling_params import StructuredOutput


@dataclass(frozen=True)
class JsonCallFormat(ToolCallFormat):
    name: str
    open_marker: str  # text before each call ("" = the call starts the answer)
    close_marker: str  # text after each call
    separator: str  # between calls in a constrained answer
    arguments_key: str  # the key holding the arguments object
    result_open: str
    result_close: str
    tokens: Mapping[str, int] = field(default_factory=dict)
    schemas: Schemas = field(default_factory=dict)
    reads_fenced_calls: bool = False  # a ```json block naming an offered tool is a call

    def markers(self) -> tuple[str, ...]:
        return (self.open_marker, self.close_marker, self.separator)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = [
            self.open_marker
            + json.dumps(
                {"name": call["name"], self.arguments_key: call["arguments"]}, ensure_ascii=False
            )
            + self.close_marker
            for call in calls
        ]
        return self.separator.join(blocks)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        body = json_rule({"anyOf": [self._call_schema(tool) for tool in tools]})
        call = seq(self.literal(self.open_marker), "body", self.literal(self.close_marker))
        start = repeat("call", self.literal(self.separator), parallel)
        return StructuredOutput("lark", f"{start_rule(start)}\ncall: {call}\nbody: {body}\n")

    def new_parser(self) -> CallParser:
        return JsonCallParser(self)

    def _call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                self.arguments_key: parameters(tool),
            },
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }


HERMES = JsonCallFormat(
    name="hermes",
    open_marker="<tool_call>\n",
    close_marker="\n</tool_call>",
    separator="\n",
    arguments_key="arguments",
    result_open="<tool_response>\n",
    result_close="\n</tool_response>",
    reads_fenced_calls=True,
)
LLAMA3_JSON = JsonCallFormat(
    name="llama3_json",
    open_marker="",
    close_marker="",
    separator="; ",
    arguments_key="parameters",
    result_open="",
    result_close="",
)


class _Scan:
    """Tracks JSON nesting over text fed to it char by char (strings and escapes aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False  # the first "{" has been seen

    def step(self, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            self.started = True
        elif char in "}]":
            self.depth -= 1

    @property
    def closed(self) -> bool:
        return self.started and self.depth == 0


_OPEN, _BODY, _AFTER, _PLAIN = "open", "body", "after", "plain"
FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\n")  # a Markdown JSON block's first line
FENCE_CLOSE = "```"
# What may still grow into FENCE_OPEN at the end of the text so far (held back until it does).
_FENCE_START = re.compile(r"`{1,3}(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*$")


class JsonCallParser:
    def __init__(self, fmt: JsonCallFormat) -> None:
        self.fmt = fmt
        self._open_marker = fmt.open_marker.strip()
        self._close_marker = fmt.close_marker.strip() or fmt.separator.strip()
        self._header = re.compile(
            r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"'
            + re.escape(fmt.arguments_key)
            + r'"\s*:\s*(?=\S)'  # the value has begun: its leading whitespace is behind us
        )
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet turned into events
        self._mode = _OPEN
        self._seen_content = False
        self._reads_fences = fmt.reads_fenced_calls and bool(fmt.schemas)
        self._opener = fmt.open_marker.strip()  # what opened the block being read, as written
        self._closer = self._close_marker  # what ends it
        self._fenced = False  # the block is a ```json one (read whole, checked against schemas)
        self._reset_body()

    def _reset_body(self) -> None:
        self._body = ""  # the call's JSON text so far (scanned up to its closing brace)
        self._scan = _Scan()
        self._args_start: int | None = None  # where the arguments value starts in _body
        self._args_end: int | None = None
        self._args_sent = 0  # chars of the arguments already streamed

    # ---- feeding -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._pending:
            before = (self._mode, self._pending)
            {_OPEN: self._find_call, _BODY: self._read_body, _AFTER: self._end_call}.get(
                self._mode, self._plain
            )(events)
            if (self._mode, self._pending) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[Event]:
        """The end of the text: release held-back text; a call cut short keeps what it had.
        A block the text ended in before its name is markup cut short: dropped, never content
        (a `<tool_call>` block; for llama3_json, whose calls are bare, an object that begins as
        a call does). An unclosed fence, or an object that is no call, is a text: content."""
        events: list[Event] = []
        if self._mode == _BODY and self._args_start is not None:
            self._stream_arguments(events, final=True)
        elif self._mode == _BODY and (self._fenced or not self._open_marker):
            if self._fenced or not _may_begin_a_call(self._body):
                self._emit_content(events, self._opener + self._body)  # a JSON text, not a call
        elif self._mode in (_OPEN, _PLAIN) and (self._pending.strip() or not self.calls):
            self._emit_content(events, self._pending)
        self._pending = ""
        return events

    # ---- modes ---------------------------------------------------------------------------------
    def _find_call(self, events: list[Event]) -> None:
        if not self._open_marker:  # the call must start the answer, after optional whitespace
            stripped = self._pending.lstrip()
            if stripped:
                is_call = stripped[0] == "{" and not self._seen_content
                self._mode = _BODY if is_call else _PLAIN
                self._pending = stripped if is_call else self._pending
            return
        start, end, fenced = self._next_opener(self._pending)
        if start >= 0:
            before = self._pending[:start]
            self._emit_content(events, before.rstrip())
            # The whitespace before the opener goes back into the text if the block is no call.
            self._opener = before[len(before.rstrip()) :] + self._pending[start:end]
            self._closer = FENCE_CLOSE if fenced else self._close_marker
            self._fenced = fenced
            self._pending = self._pending[end:]
            self._mode = _BODY
            return
        # Hold back what may begin an opener, and trailing whitespace (it may precede one).
        text = self._pending
        rest = text[: len(text) - self._held_back(text)]
        keep = len(text) - len(rest.rstrip())
        self._emit_content(events, text[: len(text) - keep])
        self._pending = text[len(text) - keep :]

    def _next_opener(self, text: str) -> tuple[int, int, bool]:
        """Where the first block opener in `text` starts and ends, and whether it is a fence
        ((-1, -1, False) when there is none yet)."""
        idx = text.find(self._open_marker)
        fence = FENCE_OPEN.search(text) if self._reads_fences else None
        if fence is not None and (idx < 0 or fence.start() < idx):
            return fence.start(), fence.end(), True
        if idx >= 0:
            return idx, idx + len(self._open_marker), False
        return -1, -1, False

    def _held_back(self, text: str) -> int:
        """How many chars at the end of `text` may be the start of an opener."""
        held = partial_suffix(text, self._open_marker)
        fence = _FENCE_START.search(text) if self._reads_fences else None
        return max(held, len(text) - fence.start()) if fence is not None else held

    def _plain(self, events: list[Event]) -> None:
        self._emit_content(events, self._pending)
        self._pending = ""

    def _read_body(self, events: list[Event]) -> None:
        consumed = 0
        for char in self._pending:
            if not self._scan.started and not char.isspace() and char != "{":
                break  # not JSON: the block is not a call
            self._step(char)
            consumed += 1
            if self._scan.closed:
                break
        self._pending = self._pending[consumed:]
        if not self._scan.started and self._pending:  # something other than "{" came first
            self._emit_content(events, self._opener + self._body)
            self._reset_body()
            self._mode = _OPEN if self._open_marker else _PLAIN
            return
        if self._args_start is None and not self._fenced:  # a fence is read whole: is it a call?
            self._match_header(events)
        if self._args_start is not None:
            self._stream_arguments(events, final=self._scan.closed)
        if self._scan.closed:
            self._close_body(events)

    def _step(self, char: str) -> None:
        depth_before, in_string = self._scan.depth, self._scan.in_string
        self._scan.step(char)
        pos = len(self._body)
        self._body += char
        if self._args_start is None or self._args_end is not None or pos < self._args_start:
            return
        if depth_before == 1 and not in_string and char in ",}":
            self._args_end = pos  # a scalar value ends before the delimiter
        elif depth_before == 2 and self._scan.depth == 1:
            self._args_end = pos + 1  # an object or array value ends with its bracket

    def _match_header(self, events: list[Event]) -> None:
        match = self._header.match(self._body)
        if match is None:
            return
        name = _load('"' + match.group(1) + '"')
        self._args_start = match.end()
        # The value may already be partly scanned: find its end in what is there.
        body, self._body, self._scan = self._body, "", _Scan()
        for char in body:
            self._step(char)
        self._start_call(events, name if isinstance(name, str) else match.group(1))

    def _start_call(self, events: list[Event], name: str) -> None:
        call = ToolCall(new_call_id(), name, "")
        self.calls.append(call)
        events.append(CallStart(len(self.calls) - 1, call.call_id, name))

    def _stream_arguments(self, events: list[Event], final: bool) -> None:
        """Stream the arguments scanned so far; trailing whitespace waits (it may end them)."""
        assert self._args_start is not None
        end = self._args_end if self._args_end is not None else len(self._body)
        text = self._body[self._args_start : end].rstrip()
        fragment = text[self._args_sent :]
        if fragment:
            self._args_sent = len(text)
            self.calls[-1].arguments += fragment
            events.append(CallArguments(len(self.calls) - 1, fragment))

    def _close_body(self, events: list[Event]) -> None:
        is_call = True
        if self._args_start is None:  # a call not written name-first (or fenced): read it whole
            call = _load(self._body)
            is_call = self._is_call(call)
            if is_call:
                self._start_call(events, call["name"])
                arguments = json.dumps(call[self.fmt.arguments_key], ensure_ascii=False)
                self.calls[-1].arguments = arguments
                events.append(CallArguments(len(self.calls) - 1, arguments))
            else:
                self._emit_content(events, self._opener + self._body)
        self._reset_body()
        # A fence that held no call keeps its closing ``` as content too.
        self._mode = _OPEN if self._fenced and not is_call else _AFTER

    def _is_call(self, call: Any) -> bool:
        args_key = self.fmt.arguments_key
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and args_key in call):
            return False
        if not self._fenced:
            return True
        return call["name"] in self.fmt.schemas and isinstance(call[args_key], dict)

    def _end_call(self, events: list[Event]) -> None:
        stripped = self._pending.lstrip()
        marker = self._closer
        if not stripped:
            return
        if marker and stripped.startswith(marker):
            self._pending = stripped[len(marker) :]
            self._mode = _OPEN
            return
        if marker and marker.startswith(stripped):
            return  # may still become the marker
        self._mode = _OPEN if self._open_marker else _PLAIN

    # ---- helpers -------------------------------------------------------------------------------
    def _emit_content(self, events: list[Event], text: str) -> None:
        if text:
            self._seen_content = self._seen_content or bool(text.strip())
            events.append(Content(text))


def _may_begin_a_call(text: str) -> bool:
    """Whether `text` is, or begins as, an object whose first key is "name" (a bare call)."""
    head = text.lstrip()
    if not head.startswith("{"):
        return False
    rest = head[1:].lstrip()
    return '"name"'.startswith(rest[:6])


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may be one)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
