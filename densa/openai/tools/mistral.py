"""Mistral's dialects, both starting a call with the control token `[TOOL_CALLS]`.

mistral (tokenizer v11 and later: Mistral Small 3.2, Magistral, Devstral): each call is the
name, `[ARGS]` and the JSON arguments (`[CALL_ID]id` may sit between name and arguments):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]ping[ARGS]{}

mistral_json (earlier tokenizers: Mistral 7B v0.3, Nemo, Small 3.1): one JSON array of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

A call runs to the next `[TOOL_CALLS]` or the end of the answer. mistral_json's calls are read
once the answer ends (the array is parsed whole), so they are not streamed piece by piece.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from densa.openai.tools.base import (
    MAX_PARALLEL_CALLS,
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

CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
RESULT_OPEN, RESULT_CLOSE = "[TOOL_RESULTS]", "[/TOOL_RESULTS]"


@dataclass(frozen=True)
class MistralFormat(ToolCallFormat):
    name: str = "mistral"
    result_open: str = RESULT_OPEN
    result_close: str = RESULT_CLOSE
    tokens: Mapping[str, int] = field(default_factory=dict)
    schemas: Schemas = field(default_factory=dict)

    def markers(self) -> tuple[str, ...]:
        return (CALLS, ARGS, CALL_ID)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "".join(
            f"{CALLS}{c['name']}{ARGS}{json.dumps(c['arguments'], ensure_ascii=False)}"
            for c in calls
        )

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        lines = [
            start_rule(repeat("call", "", parallel)),
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
        ]
        for idx, tool in enumerate(tools):
            head = self.literal(f"{CALLS}{tool['function']['name']}{ARGS}")
            lines.append(f"call_{idx}: {head} args_{idx}")
            lines.append(f"args_{idx}: {json_rule(parameters(tool))}")
        return StructuredOutput("lark", "\n".join(lines) + "\n")

    def new_parser(self) -> CallParser:
        return MarkedCallParser(Markers(CALLS), _NamedReader())


@dataclass(frozen=True)
class MistralJsonFormat(ToolCallFormat):
    name: str = "mistral_json"
    result_open: str = RESULT_OPEN
    result_close: str = RESULT_CLOSE
    tokens: Mapping[str, int] = field(default_factory=dict)
    schemas: Schemas = field(default_factory=dict)

    def markers(self) -> tuple[str, ...]:
        return (CALLS,)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        array = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
        return f"{CALLS} {json.dumps(array, ensure_ascii=False)}"

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t["function"]["name"]},
                        "arguments": parameters(t),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        }
        array = {"type": "array", "items": call, "minItems": 1}
        array["maxItems"] = MAX_PARALLEL_CALLS if parallel else 1
        start = start_rule(f'{self.literal(CALLS)} " " calls')
        lark = f"{start}\ncalls: {json_rule(array)}\n"
        return StructuredOutput("lark", lark)

    def new_parser(self) -> CallParser:
        return MarkedCallParser(Markers(CALLS), _ArrayReader())


class _NamedReader:
    def read(self, body: str, final: bool) -> list[CallRead] | None:
        head, found, arguments = body.partition(ARGS)
        if not found:
            return None
        name, _, call_id = head.partition(CALL_ID)
        if not name.strip():
            return None
        return [CallRead(name.strip(), arguments.strip(), call_id.strip() or None)]


class _ArrayReader:
    def read(self, body: str, final: bool) -> list[CallRead] | None:
        if not final:
            return None
        try:
            array = json.loads(body)
        except ValueError:
            return None
        if not isinstance(array, list) or not all(_is_call(c) for c in array):
            return None
        return [CallRead(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in array]


def _is_call(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value
