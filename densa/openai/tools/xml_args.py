"""Dialects that write each argument as its own tagged value, as text: GLM and Qwen3-Coder.

glm (GLM 4.5 and later):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

qwen3_coder (Qwen3-Coder's XML):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A string value is written as is, any other as JSON. Reading them back into OpenAI's JSON
arguments needs the tool's schema (is "3" a string or a number?): bound with `with_tools`, the
schema decides; unbound, a value that parses as JSON is taken as that JSON. The arguments stream
one whole value at a time. Under a constraint, values follow the schema's property order,
required ones always present; string values are free text (their enum is enforced, not
their length or pattern), other values are JSON valid under their schema.
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
from densa.openai.tools.events import CallParser
from densa.openai.tools.marked import CallRead, MarkedCallParser, Markers
from densa.sampling_params import StructuredOutput


@dataclass(frozen=True)
class _Layout:
    """Where a dialect writes the name and each value (the text between the pieces)."""

    call_open: str
    call_close: str
    name_open: str  # between call_open and the name
    name_close: str  # after the name
    key_open: str  # before an argument's name
    key_close: str  # between its name and its value
    value_close: str
    values_close: str  # after the last value
    separator: str  # between calls
    header: re.Pattern[str]  # the name, from the start of a block
    value: re.Pattern[str]  # (key, value) pairs


GLM_LAYOUT = _Layout(
    "<tool_call>", "</tool_call>", "", "\n", "<arg_key>", "</arg_key>\n<arg_value>",
    "</arg_value>\n", "", "\n",
    re.compile(r"\s*([^\s<]+)(?=\s|<)"),
    re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL),
)  # fmt: skip
QWEN3_CODER_LAYOUT = _Layout(
    "<tool_call>", "</tool_call>", "\n<function=", ">\n", "<parameter=", ">\n",
    "\n</parameter>\n", "</function>\n", "\n",
    re.compile(r"\s*<function=([^>\n]+)>"),
    re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL),
)  # fmt: skip
_TEXT_RULE = "TEXT: /(.|\\n)*/"


@dataclass(frozen=True)
class XmlArgsFormat(ToolCallFormat):
    name: str
    layout: _Layout
    result_open: str = "<tool_response>\n"
    result_close: str = "\n</tool_response>"
    tokens: Mapping[str, int] = field(default_factory=dict)
    schemas: Schemas = field(default_factory=dict)

    def markers(self) -> tuple[str, ...]:
        lay = self.layout
        return (lay.call_open, lay.call_close, lay.name_open, lay.key_open, lay.key_close,
                lay.value_close, lay.values_close)  # fmt: skip

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return self.layout.separator.join(self._render(c["name"], c["arguments"]) for c in calls)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        lay = self.layout
        lines = [
            start_rule(repeat("call", self.literal(lay.separator), parallel)),
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
            _TEXT_RULE,
        ]
        for idx, tool in enumerate(tools):
            head = self.literal(
                lay.call_open + lay.name_open + tool["function"]["name"] + lay.name_close
            )
            values = self._value_rules(f"v{idx}", parameters(tool), lines)
            tail = self.literal(lay.values_close + lay.call_close)
            lines.append(f"call_{idx}: {head} {values} {tail}")
        return StructuredOutput("lark", "\n".join(lines) + "\n")

    def new_parser(self) -> CallParser:
        markers = Markers(self.layout.call_open, self.layout.call_close)
        return MarkedCallParser(markers, _Reader(self.layout, self.schemas))

    def _render(self, name: str, arguments: dict[str, Any]) -> str:
        lay = self.layout
        values = "".join(
            f"{lay.key_open}{key}{lay.key_close}{_as_text(value)}{lay.value_close}"
            for key, value in arguments.items()
        )
        head = f"{lay.call_open}{lay.name_open}{name}{lay.name_close}"
        return f"{head}{values}{lay.values_close}{lay.call_close}"

    def _value_rules(self, prefix: str, schema: Mapping[str, Any], lines: list[str]) -> str:
        """Rules for each property's tagged value (appended to `lines`); their sequence."""
        lay = self.layout
        required = set(schema.get("required", ()))
        sequence = []
        for idx, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            sub = sub if isinstance(sub, Mapping) else {}  # `true`: any value
            rule = f"{prefix}_{idx}"
            opening = self.literal(f"{lay.key_open}{key}{lay.key_close}")
            closing = self.literal(lay.value_close)
            if _is_text(sub) and "enum" in sub:
                choices = " | ".join(json.dumps(v) for v in sub["enum"])
                lines.append(f"{rule}: {opening} ({choices}) {closing}")
            elif _is_text(sub) and closing.startswith("<["):  # text ends at the closing token
                lines.append(f"{rule}: {opening} TEXT {closing}")
            elif _is_text(sub):  # free text, up to the first closing tag
                lines.append(f"{rule}: {opening} {rule}_text")
                lines.append(f"{rule}_text[lazy]: TEXT {closing}")
            else:
                lines.append(f"{rule}: {opening} {rule}_json {closing}")
                lines.append(f"{rule}_json: {json_rule(sub)}")
            sequence.append(rule if key in required else f"{rule}?")
        return " ".join(sequence)


GLM = XmlArgsFormat("glm", GLM_LAYOUT)
QWEN3_CODER = XmlArgsFormat("qwen3_coder", QWEN3_CODER_LAYOUT)


class _Reader:
    """Reads a block's values once each: a block is read again as every piece of it arrives,
    so only text past the last complete value is searched, and only once a closing tag came."""

    def __init__(self, layout: _Layout, schemas: Schemas) -> None:
        self.layout = layout
        self.schemas = schemas
        self._close = layout.value_close.strip()
        self._reset()

    def _reset(self) -> None:
        self._head = ""  # the block up to the end of its last complete value
        self._members: list[str] = []  # those values, as JSON object members
        self._searched = 0  # the block has been searched for a closing tag up to here

    def read(self, body: str, final: bool) -> list[CallRead] | None:
        header = self.layout.header.match(body if not final else body + "\n")
        if header is None:
            return None
        if not body.startswith(self._head):  # another block
            self._reset()
        name = header.group(1).strip()
        since = max(self._searched - len(self._close), len(self._head))
        if final or body.find(self._close, since) >= 0:
            properties = (self.schemas.get(name) or {}).get("properties") or {}
            for match in self.layout.value.finditer(body, max(len(self._head), header.end())):
                key, value = match.group(1).strip(), match.group(2)
                member = f"{json.dumps(key, ensure_ascii=False)}: "
                self._members.append(member + value_json(value, properties.get(key)))
                self._head = body[: match.end()]
        self._searched = len(body)
        return [CallRead(name, "{" + ", ".join(self._members) + ("}" if final else ""))]


def value_json(text: str, schema: Mapping[str, Any] | None) -> str:
    """A value the model wrote as text, as JSON: a string where the schema says so (or where
    the text is not JSON), else the JSON it is."""
    if schema is not None and _is_text(schema):
        return json.dumps(text, ensure_ascii=False)
    try:
        json.loads(text)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    return text.strip()


def _is_text(schema: Mapping[str, Any]) -> bool:
    """Whether values of `schema` are strings (written as plain text)."""
    if schema.get("type") == "string":
        return True
    choices = schema.get("enum")
    return isinstance(choices, list) and bool(choices) and all(isinstance(c, str) for c in choices)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
