"""An OpenAI Responses request as the chat request densa already serves.

Field by field:

    instructions                          -> a first "system" message
    input (text)                          -> one "user" message
    message items                         -> messages of their role (text parts joined by "\\n")
    function_call items                   -> tool_calls of the assistant turn they follow
    function_call_output items            -> "tool" messages
    reasoning items                       -> reasoning_content of the assistant turn they open
    tools (flat: name, parameters)        -> function tools
    tool_choice, parallel_tool_calls, temperature, top_p, user, prompt_cache_key,
    safety_identifier                     -> the same chat fields
    max_output_tokens                     -> max_tokens
    text.format                           -> response_format
    reasoning.effort                      -> reasoning_effort
"""

from __future__ import annotations

from typing import Any

from densa.openai.prepare import parse
from densa.openai.protocol import ChatCompletionRequest
from densa.openai.responses_api.models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
)


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """Raises APIError (400) if the translated request is one chat refuses."""
    data: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.instructions, body.input),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "tools": [_tool(tool) for tool in body.tools] if body.tools is not None else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "safety_identifier": body.safety_identifier,
        "speculative": None if body.speculative else False,  # only an opt-out is set
    }
    return parse(ChatCompletionRequest, {k: v for k, v in data.items() if v is not None})


def chat_messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    chat = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(items, str):
        return [*chat, {"role": "user", "content": items}]
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they open
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text)
            continue
        if isinstance(item, MessageItem):
            chat.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            _add_call(chat, item)
        else:
            chat.append(_tool_result(item))
        if reasoning and chat[-1]["role"] == "assistant":
            chat[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    return chat


def _add_call(chat: list[dict[str, Any]], item: FunctionCallItem) -> None:
    """A call joins the assistant turn it follows (an answer's text and calls are one turn)."""
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }
    if chat and chat[-1]["role"] == "assistant":
        chat[-1].setdefault("tool_calls", []).append(call)
    else:
        chat.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _tool_result(item: FunctionCallOutputItem) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": item.call_id, "content": item.text}


def _tool(tool: FunctionTool) -> dict[str, Any]:
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    if text is None or text.format is None:
        return None
    spec = text.format
    if spec.type != "json_schema":
        return {"type": spec.type}
    schema = {"name": spec.name or "answer", "schema": spec.json_schema, "strict": spec.strict}
    if spec.description is not None:
        schema["description"] = spec.description
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }
