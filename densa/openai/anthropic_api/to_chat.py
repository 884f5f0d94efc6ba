"""An Anthropic Messages request as the chat request densa already serves, field by field:

    system (text or text blocks)           -> a first "system" message
    user text blocks                       -> a "user" message (blocks joined by "\\n")
    user tool_result blocks                -> "tool" messages, in order (is_error: "error: ...")
    assistant text + tool_use blocks       -> an "assistant" message with content and tool_calls
    assistant thinking blocks              -> its reasoning_content (redacted_thinking: dropped)
    thinking {"type": "disabled"}          -> reasoning_effort "none" (the template's switch off)
    tools {name, description, input_schema}-> function tools
    tool_choice auto / any / tool / none   -> auto / required / that function / none
    disable_parallel_tool_use              -> parallel_tool_calls: false
    stop_sequences, max_tokens, temperature, top_p, top_k, stream -> the same chat fields
    metadata.user_id                       -> user (it narrows the prefix-cache scope)

A final assistant message is continued, as Anthropic does (and as chat does for a final
assistant message without calls).
"""

from __future__ import annotations

import json
from typing import Any

from densa.openai.anthropic_api.models import (
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)
from densa.openai.prepare import parse
from densa.openai.protocol import ChatCompletionRequest


def to_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """Raises APIError (400) if the translated request is one chat refuses."""
    data: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.system, body.messages),
        "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": _parallel(body.tool_choice),
        "reasoning_effort": "none" if body.thinking and body.thinking.type == "disabled" else None,
    }
    if isinstance(body, MessagesRequest):
        data |= {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
            "stream": body.stream,
            "user": body.metadata.user_id if body.metadata else None,
            "speculative": None if body.speculative else False,  # only an opt-out is set
        }
    return parse(ChatCompletionRequest, {k: v for k, v in data.items() if v is not None})


def chat_messages(
    system: str | list[TextBlock] | None, messages: list[InputMessage]
) -> list[dict[str, Any]]:
    chat = [] if system is None else [{"role": "system", "content": _text(system)}]
    for message in messages:
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            chat.append(_assistant(message.content))
        else:
            chat += _user(message.content)
    return chat


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    texts = [block.text for block in blocks if isinstance(block, TextBlock)]
    calls = [_call(block) for block in blocks if isinstance(block, ToolUseBlock)]
    thoughts = [block.thinking for block in blocks if isinstance(block, ThinkingBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _call(block: ToolUseBlock) -> dict[str, Any]:
    arguments = json.dumps(block.input, ensure_ascii=False)
    function = {"name": block.name, "arguments": arguments}
    return {"id": block.id, "type": "function", "function": function}


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    """Tool results become tool messages; runs of text between them, user messages."""
    chat: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if texts:
                chat.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            chat.append(_tool_result(block))
        elif isinstance(block, TextBlock):
            texts.append(block.text)
    if texts or not chat:
        chat.append({"role": "user", "content": "\n".join(texts)})
    return chat


def _tool_result(block: ToolResultBlock) -> dict[str, Any]:
    content = f"error: {block.text}" if block.is_error else block.text
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _text(system: str | list[TextBlock]) -> str:
    return system if isinstance(system, str) else "\n".join(block.text for block in system)


def _tools(tools: list[ToolSpec] | None) -> list[dict[str, Any]] | None:
    return None if tools is None else [_tool(tool) for tool in tools]


def _tool(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _parallel(choice: ToolChoice | None) -> bool | None:
    return False if choice is not None and choice.disable_parallel_tool_use else None
