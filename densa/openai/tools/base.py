"""What every tool-call dialect provides (`ToolCallFormat`), and the pieces dialects share.

A dialect is a frozen dataclass: how a model family writes calls (`render_calls`), reads them
back (`new_parser`), and constrains them (`call_grammar`, a Lark grammar whose every output is
one or more calls of the offered tools). Two bindings make it concrete for one server:

- `with_vocabulary`: the markers that are added tokens of the model's vocabulary, so grammars
  match them as tokens (openai/tools/lark.py);
- `with_tools`: the request's tool schemas, for dialects that write argument values as text
  (GLM, Qwen3-Coder) and must know which values are strings.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from densa.openai.tools.events import CallParser
from densa.openai.tools.lark import literal, marker_tokens
from densa.sampling_params import JSON_STYLE, StructuredOutput

# A constrained answer holds at most this many calls: a model that never chooses to stop must
# still end (OpenAI sets no limit; agents rarely need more in one turn).
MAX_PARALLEL_CALLS = 8

Schemas = Mapping[str, Mapping[str, Any]]  # tool name -> its parameters schema


class ToolCallFormat(ABC):
    name: str
    result_open: str  # tool results are wrapped in these when densa renders them as text
    result_close: str
    # The vocabulary's added tokens found in the markers (text -> id). Empty until bound.
    tokens: Mapping[str, int]
    schemas: Schemas  # the request's tools; empty until bound

    @abstractmethod
    def markers(self) -> tuple[str, ...]:
        """The literal texts this dialect writes around calls (matched as tokens if they are)."""

    @abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant turn's calls as this dialect writes them ({name, arguments(dict)})."""

    @abstractmethod
    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        """A grammar whose every output is one call (or several, if parallel) of these tools,
        with arguments valid under each tool's parameter schema."""

    @abstractmethod
    def new_parser(self) -> CallParser: ...

    # ---- bindings --------------------------------------------------------------------------
    def with_vocabulary(self, added_tokens: Mapping[str, int]) -> ToolCallFormat:
        """This dialect for a tokenizer whose added tokens are `added_tokens` (text -> id)."""
        return replace(self, tokens=marker_tokens(self.markers(), added_tokens))  # type: ignore[type-var]

    def with_tools(self, tools: list[dict[str, Any]]) -> ToolCallFormat:
        """This dialect reading calls of these tools (OpenAI's JSON shape)."""
        return replace(self, schemas={t["function"]["name"]: parameters(t) for t in tools})  # type: ignore[type-var]

    # ---- prompts ---------------------------------------------------------------------------
    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Tool definitions as text, for templates that cannot render `tools` themselves."""
        definitions = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        example = self.render_calls([{"name": "<function name>", "arguments": {"<arg>": "..."}}])
        return (
            "You can call functions to help answer. These are the functions, as JSON:\n"
            f"<tools>\n{definitions}\n</tools>\n"
            "To call a function, answer with exactly this and nothing else:\n"
            f"{example}\n"
            "Use only the functions above and only their parameters. After a call you get the "
            f"result in {self.result_open}...{self.result_close}; then answer the user."
        )

    def render_result(self, content: str) -> str:
        return f"{self.result_open}{content}{self.result_close}"

    # ---- grammar pieces --------------------------------------------------------------------
    def literal(self, text: str) -> str:
        """`text` as a Lark expression, its marker tokens as tokens."""
        return literal(text, self.tokens)


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema (an empty object schema when it takes none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule body for JSON valid under `schema`, written as densa writes JSON."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"


# Whitespace a model may write after its last call before it ends the turn: Qwen2.5-Coder writes
# "</tool_call>\n" and then its end token. A grammar that ends right after the last marker
# leaves such a model the choice between another call and nothing: it wrote calls until
# max_tokens. (The parser drops whitespace after the calls: it is not an answer.)
TRAILING_SPACE = "/[ \\t\\r\\n]{0,4}/"


def start_rule(calls: str) -> str:
    """The grammar's start rule: `calls` (a Lark expression), then the end of the turn."""
    return f"start: {calls} {TRAILING_SPACE}"


def repeat(rule: str, separator: str, parallel: bool) -> str:
    """`rule` once, or up to MAX_PARALLEL_CALLS times with `separator` (a Lark expression)."""
    if not parallel:
        return rule
    return f"{rule} ({separator} {rule})~0..{MAX_PARALLEL_CALLS - 1}".replace("( ", "(")
