"""Kimi K2's dialect: calls in a section, each named by an id `functions.NAME:IDX`.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(one line, broken here to fit).

The id is the call's id (Kimi's template writes it back into the history), the name its middle.
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
from densa.openai.tools.marked import CallRead, MarkedCallParser, Markers
from densa.sampling_params import StructuredOutput

SECTION_OPEN, SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGUMENTS = "<|tool_call_argument_begin|>"


@dataclass(frozen=True)
class KimiK2Format(ToolCallFormat):
    name: str = "kimi_k2"
    result_open: str = ""
    result_close: str = ""
    tokens: Mapping[str, int] = field(default_factory=dict)
    schemas: Schemas = field(default_factory=dict)

    def markers(self) -> tuple[str, ...]:
        return (SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, CALL_CLOSE, ARGUMENTS)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = [
            f"{CALL_OPEN}functions.{c['name']}:{idx}{ARGUMENTS}"
            f"{json.dumps(c['arguments'], ensure_ascii=False)}{CALL_CLOSE}"
            for idx, c in enumerate(calls)
        ]
        return SECTION_OPEN + "".join(blocks) + SECTION_CLOSE

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        lines = [
            start_rule(
                f"{self.literal(SECTION_OPEN)} {repeat('call', '', parallel)} "
                f"{self.literal(SECTION_CLOSE)}"
            ),
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
            "INDEX: /[0-9]{1,3}/",
        ]
        for idx, tool in enumerate(tools):
            head = self.literal(f"{CALL_OPEN}functions.{tool['function']['name']}:")
            lines.append(
                f"call_{idx}: {head} INDEX {self.literal(ARGUMENTS)} args_{idx} "
                f"{self.literal(CALL_CLOSE)}"
            )
            lines.append(f"args_{idx}: {json_rule(parameters(tool))}")
        return StructuredOutput("lark", "\n".join(lines) + "\n")

    def new_parser(self) -> CallParser:
        markers = Markers(CALL_OPEN, CALL_CLOSE, SECTION_OPEN, SECTION_CLOSE)
        return MarkedCallParser(markers, _Reader())


class _Reader:
    def read(self, body: str, final: bool) -> list[CallRead] | None:
        head, found, arguments = body.partition(ARGUMENTS)
        if not found:
            return None
        call_id = head.strip()
        name = call_id.split(":")[0].split(".")[-1]
        return [CallRead(name, arguments.strip(), call_id)] if name else None
