"""gpt-oss's harmony dialect: a call is a commentary message to `functions.NAME`, its arguments
the message, usually constrained to JSON (densa.openai.harmony has the whole format):

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(one line, broken here to fit). With `--reasoning-parser harmony` the split hands every call on
as `<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>` wherever the model put its
recipient; without it, the calls written with the recipient after the channel are read from the
raw text. `<|call|>` ends the turn (an end token), so a call the text ends in is complete.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from densa.openai.harmony import CALL, CALL_OPEN, CHANNEL, CONSTRAIN, MESSAGE, START
from densa.openai.tools.base import Schemas, ToolCallFormat, json_rule, parameters, start_rule
from densa.openai.tools.events import CallParser
from densa.openai.tools.marked import CallRead, MarkedCallParser, Markers
from densa.sampling_params import StructuredOutput

NAMESPACE = "functions."


@dataclass(frozen=True)
class HarmonyFormat(ToolCallFormat):
    name: str = "harmony"
    result_open: str = ""
    result_close: str = ""
    tokens: Mapping[str, int] = field(default_factory=dict)
    schemas: Schemas = field(default_factory=dict)

    def markers(self) -> tuple[str, ...]:
        return (START, CHANNEL, CONSTRAIN, MESSAGE, CALL)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "".join(
            f"{START}assistant{CALL_OPEN}{NAMESPACE}{c['name']} {CONSTRAIN}json{MESSAGE}"
            f"{json.dumps(c['arguments'], ensure_ascii=False)}{CALL}"
            for c in calls
        )

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        """One call (harmony ends the turn at <|call|>: never several), from its header on."""
        lines = [start_rule("call"), "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for idx, tool in enumerate(tools):
            head = self.literal(f"{CALL_OPEN}{NAMESPACE}{tool['function']['name']} ")
            lines.append(
                f'call_{idx}: {head} {self.literal(CONSTRAIN)} "json" {self.literal(MESSAGE)} '
                f"args_{idx} {self.literal(CALL)}"
            )
            lines.append(f"args_{idx}: {json_rule(parameters(tool))}")
        return StructuredOutput("lark", "\n".join(lines) + "\n")

    def new_parser(self) -> CallParser:
        return MarkedCallParser(Markers(CALL_OPEN, CALL), _Reader())


class _Reader:
    def read(self, body: str, final: bool) -> list[CallRead] | None:
        """`functions.NAME[ <|constrain|>json]<|message|>ARGS` -> the call."""
        head, found, arguments = body.partition(MESSAGE)
        if not found:
            return None
        words = head.split(CONSTRAIN)[0].split()
        recipient = words[0] if words else ""  # `to=<|constrain|>json` names no function
        if not recipient.startswith(NAMESPACE):
            return None
        name = recipient.removeprefix(NAMESPACE)
        return [CallRead(name, arguments.strip())] if name else None
