"""DeepSeek's dialects: calls in a section, the name and the JSON arguments split by a separator.

deepseek_v3 (V3, V3-0324, R1): a type, the name, then the arguments in a json code fence;
calls separated by a newline:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

deepseek_v31 (V3.1 and later): the name, then the bare arguments:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>          (one line: broken here to fit)

One reader takes both forms. (The bars are U+FF5C and the spaces U+2581, as in the tokens.)
"""

from __future__ import annotations

import json
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
from densa.openai.tools.json_calls import partial_suffix
from densa.openai.tools.marked import CallRead, MarkedCallParser, Markers
from densa.sampling_params import StructuredOutput

SECTION_OPEN, SECTION_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_OPEN, CALL_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"
RESULT_OPEN, RESULT_CLOSE = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"


@dataclass(frozen=True)
class DeepSeekFormat(ToolCallFormat):
    name: str = "deepseek_v3"
    fenced: bool = True  # V3's "function<sep>NAME\n```json ...```" (else V3.1's "NAME<sep>{...}")
    result_open: str = RESULT_OPEN
    result_close: str = RESULT_CLOSE
    tokens: Mapping[str, int] = field(default_factory=dict)
    schemas: Schemas = field(default_factory=dict)

    def markers(self) -> tuple[str, ...]:
        return (SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, CALL_CLOSE, SEPARATOR)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = [
            self._head(c["name"]) + json.dumps(c["arguments"], ensure_ascii=False) + self._tail()
            for c in calls
        ]
        return SECTION_OPEN + ("\n" if self.fenced else "").join(blocks) + SECTION_CLOSE

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        separator = self.literal("\n") if self.fenced else ""
        lines = [
            start_rule(
                f"{self.literal(SECTION_OPEN)} {repeat('call', separator, parallel)} "
                f"{self.literal(SECTION_CLOSE)}"
            ),
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
        ]
        for idx, tool in enumerate(tools):
            head = self.literal(self._head(tool["function"]["name"]))
            lines.append(f"call_{idx}: {head} args_{idx} {self.literal(self._tail())}")
            lines.append(f"args_{idx}: {json_rule(parameters(tool))}")
        return StructuredOutput("lark", "\n".join(lines) + "\n")

    def new_parser(self) -> CallParser:
        markers = Markers(CALL_OPEN, CALL_CLOSE, SECTION_OPEN, SECTION_CLOSE)
        return MarkedCallParser(markers, _Reader())

    def _head(self, name: str) -> str:
        if self.fenced:
            return f"{CALL_OPEN}function{SEPARATOR}{name}\n{FENCE_OPEN}"
        return f"{CALL_OPEN}{name}{SEPARATOR}"

    def _tail(self) -> str:
        return (FENCE_CLOSE if self.fenced else "") + CALL_CLOSE


class _Reader:
    def read(self, body: str, final: bool) -> list[CallRead] | None:
        head, found, rest = body.partition(SEPARATOR)
        if not found:
            return None
        if head.strip() != "function":  # V3.1: the name comes before the separator
            name = head.strip()
            return [CallRead(name, rest.strip())] if name else None
        name, newline, rest = rest.partition("\n")  # V3: the name, then the fenced arguments
        if not newline and not final:
            return None
        rest, opener = rest.lstrip(), FENCE_OPEN.strip()
        if rest.startswith(opener):
            rest = rest[len(opener) :]
        elif opener.startswith(rest) and not final:
            rest = ""  # the fence is still being written
        return [CallRead(name.strip(), _unfenced(rest, final))] if name.strip() else None


def _unfenced(text: str, final: bool) -> str:
    """JSON text before the closing fence; while streaming, what may become the fence waits."""
    text = text.strip()
    fence = FENCE_CLOSE.strip()
    if text.endswith(fence):
        return text[: -len(fence)].rstrip()
    if not final:
        text = text[: len(text) - partial_suffix(text, fence)].rstrip()
    return text
