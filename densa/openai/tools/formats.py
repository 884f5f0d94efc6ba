"""The tool-call dialects, in a registry (`densa serve --tool-call-format NAME`), and how one is
chosen from the model's chat template when none is named.

    hermes        <tool_call>{"name": ..., "arguments": ...}</tool_call>      json_calls.py
    llama3_json   {"name": ..., "parameters": ...}                          json_calls.py
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0...  kimi_k2.py
    deepseek_v3   <｜tool▁calls▁begin｜>...function<｜tool▁sep｜>NAME ```json    deepseek.py
    deepseek_v31  <｜tool▁calls▁begin｜>...NAME<｜tool▁sep｜>{...}          deepseek.py
    glm           <tool_call>NAME <arg_key>k</arg_key><arg_value>v</arg_value>  xml_args.py
    qwen3_coder   <tool_call><function=NAME><parameter=k>v</parameter>...     xml_args.py
    mistral       [TOOL_CALLS]NAME[ARGS]{...}                               mistral.py
    mistral_json  [TOOL_CALLS] [{"name": ..., "arguments": ...}]              mistral.py
    harmony       <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
                  (gpt-oss; with --reasoning-parser harmony)                 harmony_calls.py

For a chat template that cannot render tools (the bundled SmolLM2's), densa writes the tool
definitions into the system message itself and renders earlier calls and tool results as the
dialect writes them (openai/tools/render.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from densa.openai.tools.base import MAX_PARALLEL_CALLS, ToolCallFormat
from densa.openai.tools.deepseek import DeepSeekFormat
from densa.openai.tools.harmony_calls import HarmonyFormat
from densa.openai.tools.json_calls import HERMES, LLAMA3_JSON, JsonCallFormat
from densa.openai.tools.kimi_k2 import KimiK2Format
from densa.openai.tools.mistral import MistralFormat, MistralJsonFormat
from densa.openai.tools.xml_args import GLM, QWEN3_CODER

if TYPE_CHECKING:
    from densa.text.tokenizer import Tokenizer

__all__ = ["AUTO", "DEFAULT_TOOL_FORMAT", "HERMES", "LLAMA3_JSON", "MAX_PARALLEL_CALLS",
           "TOOL_FORMATS", "JsonCallFormat", "ToolCallFormat", "detect_format", "format_for",
           "resolve_format", "tool_format"]  # fmt: skip

_ALL: tuple[ToolCallFormat, ...] = (
    HERMES,
    LLAMA3_JSON,
    KimiK2Format(),
    DeepSeekFormat("deepseek_v3", fenced=True),
    DeepSeekFormat("deepseek_v31", fenced=False),
    GLM,
    QWEN3_CODER,
    MistralFormat(),
    MistralJsonFormat(),
    HarmonyFormat(),
)
TOOL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in _ALL}
AUTO = "auto"  # choose from the chat template
DEFAULT_TOOL_FORMAT = AUTO
FALLBACK_FORMAT = HERMES.name  # templates that show no dialect (densa then renders tools)

# What each family's chat template writes, checked in this order (the first match wins).
_TEMPLATE_SIGNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|constrain|>")),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("deepseek_v3", ("tool▁calls▁begin", "```json")),
    ("deepseek_v31", ("tool▁calls▁begin",)),
    ("glm", ("<arg_key>",)),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("mistral", ("[TOOL_CALLS]", "[ARGS]")),
    ("mistral_json", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|start_header_id|>", '"parameters"')),
)


def tool_format(name: str) -> ToolCallFormat:
    if name not in TOOL_FORMATS:
        choices = ", ".join([AUTO, *TOOL_FORMATS])
        raise ValueError(f"unknown tool-call format {name!r}; choose from {choices}")
    return TOOL_FORMATS[name]


def detect_format(chat_template: str | None) -> str:
    """The dialect whose markers the chat template writes (hermes when it shows none)."""
    for name, signs in _TEMPLATE_SIGNS:
        if chat_template and all(sign in chat_template for sign in signs):
            return name
    return FALLBACK_FORMAT


def format_for(name: str, added_tokens: Mapping[str, int]) -> ToolCallFormat:
    """The named dialect, bound to a vocabulary whose added tokens are `added_tokens`."""
    return tool_format(name).with_vocabulary(added_tokens)


def resolve_format(name: str | None, tokenizer: Tokenizer) -> ToolCallFormat:
    """The dialect to serve: the named one, or (None / "auto") the chat template's; bound to
    the tokenizer's vocabulary."""
    if name in (None, AUTO):
        name = detect_format(tokenizer.chat_template)
    return format_for(name, tokenizer.added_tokens)
