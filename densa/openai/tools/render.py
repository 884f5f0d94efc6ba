"""Chat messages with tools into the dicts a chat template renders.

A template that renders tools itself (Hermes, Qwen, Llama 3 templates) gets OpenAI's structure
as Hugging Face templates expect it: `tools=`, assistant `tool_calls` with arguments as dicts,
`tool` messages. A template that cannot (the bundled SmolLM2's plain ChatML) gets text: the tool
definitions in the system message (`ToolCallFormat.system_prompt`), earlier calls written as the
format writes them, and tool results wrapped as the format wraps them. A template that renders
calls and results but not the definitions (DeepSeek V3.1's: its users put them in the system
prompt) gets the structure, and the definitions in the system message.
"""

from __future__ import annotations

import json
from typing import Any

from densa.openai.tools.formats import ToolCallFormat


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    fmt: ToolCallFormat,
    template_renders_tools: bool,
    template_renders_calls: bool | None = None,
) -> list[dict[str, Any]]:
    """`messages` as template dicts, where an assistant turn may carry `tool_calls` in OpenAI's
    shape (arguments as JSON text). `template_renders_calls` (None: as `template_renders_tools`)
    says whether the template writes `tool_calls` and `tool` messages itself."""
    renders_calls = (
        template_renders_tools if template_renders_calls is None else template_renders_calls
    )
    rendered = [_structured(m) if renders_calls else _as_text(m, fmt) for m in messages]
    if tools and not template_renders_tools:
        rendered = _with_tool_prompt(rendered, fmt.system_prompt(tools))
    return rendered


def _structured(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = [
        {
            "id": call["id"],
            "type": "function",
            "function": {
                "name": call["function"]["name"],
                "arguments": json.loads(call["function"]["arguments"]),
            },
        }
        for call in calls
    ]
    return {**message, "tool_calls": converted}


def _as_text(message: dict[str, Any], fmt: ToolCallFormat) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        written = fmt.render_calls(
            [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in calls
            ]
        )
        content = message.get("content") or ""
        return {"role": "assistant", "content": f"{content}\n{written}" if content else written}
    if message["role"] == "tool":
        return {"role": "tool", "content": fmt.render_result(message.get("content") or "")}
    return {k: v for k, v in message.items() if k != "tool_calls"}


def _with_tool_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
