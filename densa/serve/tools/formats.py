"""How one model family writes tool calls: markers, key names, prompt text, and call grammars.

Two formats, in a registry (`TOOL_FORMATS`, chosen with `densa serve --tool-call-format`):

hermes (the default; Hermes / Qwen style), one call per block, blocks back to back:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

llama3_json (Llama 3.x): the answer is the call itself, several separated by "; ":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

For a chat template that cannot render tools (the bundled SmolLM2's), densa writes the tool
definitions into the system message itself, in the text `system_prompt` returns, and renders
earlier calls and tool results as the format writes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from densa.sampling_params import JSON_STYLE, StructuredOutput
from densa.serve.tools.lark import literal, marker_tokens, seq

# A constrained answer holds at most this many calls: a model that never chooses to stop must
# still end (OpenAI sets no limit; agents rarely need more in one turn).
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    open_marker: str  # text before each call ("" = the call starts the answer)
    close_marker: str  # text after each call
    separator: str  # between calls in a constrained answer
    arguments_key: str  # the key holding the arguments object
    result_open: str  # tool results are wrapped in these when densa renders them
    result_close: str
    # The vocabulary's added tokens found in the markers (text -> id): grammars match these as
    # tokens (serve/tools/lark.py). Empty until bound to a tokenizer with `with_vocabulary`.
    tokens: Mapping[str, int] = field(default_factory=dict)

    def with_vocabulary(self, added_tokens: Mapping[str, int]) -> ToolCallFormat:
        """This format for a tokenizer whose added tokens are `added_tokens` (text -> id)."""
        markers = (self.open_marker, self.close_marker, self.separator)
        return replace(self, tokens=marker_tokens(markers, added_tokens))

    # ---- prompts -------------------------------------------------------------------------------
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

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant turn's calls as this format writes them ({name, arguments(dict)})."""
        blocks = [
            self.open_marker
            + json.dumps(
                {"name": call["name"], self.arguments_key: call["arguments"]}, ensure_ascii=False
            )
            + self.close_marker
            for call in calls
        ]
        return self.separator.join(blocks)

    def render_result(self, content: str) -> str:
        return f"{self.result_open}{content}{self.result_close}"

    # ---- constraints ---------------------------------------------------------------------------
    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        """A grammar whose every output is one call (or several, if parallel) of these tools,
        with arguments valid under each tool's parameter schema."""
        body = {"anyOf": [self._call_schema(tool) for tool in tools], "x-guidance": JSON_STYLE}
        call = seq(self._literal(self.open_marker), "body", self._literal(self.close_marker))
        more = MAX_PARALLEL_CALLS - 1 if parallel else 0
        start = f"call ({seq(self._literal(self.separator), 'call')})~0..{more}" if more else "call"
        lark = f"start: {start}\ncall: {call}\nbody: %json {json.dumps(body)}\n"
        return StructuredOutput("lark", lark)

    def _literal(self, text: str) -> str:
        return literal(text, self.tokens)

    def _call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }


HERMES = ToolCallFormat(
    name="hermes",
    open_marker="<tool_call>\n",
    close_marker="\n</tool_call>",
    separator="\n",
    arguments_key="arguments",
    result_open="<tool_response>\n",
    result_close="\n</tool_response>",
)
LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    open_marker="",
    close_marker="",
    separator="; ",
    arguments_key="parameters",
    result_open="",
    result_close="",
)
TOOL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON)}
DEFAULT_TOOL_FORMAT = HERMES.name


def tool_format(name: str) -> ToolCallFormat:
    if name not in TOOL_FORMATS:
        raise ValueError(
            f"unknown tool-call format {name!r}; choose from {', '.join(TOOL_FORMATS)}"
        )
    return TOOL_FORMATS[name]


def format_for(name: str, added_tokens: Mapping[str, int]) -> ToolCallFormat:
    """The named format, bound to a vocabulary whose added tokens are `added_tokens`."""
    return tool_format(name).with_vocabulary(added_tokens)
