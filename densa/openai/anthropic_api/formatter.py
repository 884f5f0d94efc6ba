"""Engine outputs as an Anthropic Message, or as its stream of events; errors in Anthropic's shape.

A stream is

    message_start (usage so far: the prompt) - ping
    per content block: content_block_start - content_block_delta* - content_block_stop
        (thinking_delta for the reasoning, text_delta for text, input_json_delta for a tool_use
        block's input JSON)
    message_delta (stop_reason, stop_sequence, final usage) - message_stop

and its blocks are exactly the non-streamed answer's (openai/blocks.py). A tool_use block's `input`
is the arguments object the model wrote; in a non-streamed answer, arguments that are not a JSON
object (a call cut short by max_tokens) give `{}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from densa.openai.anthropic_api.models import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorBody,
    ErrorDetail,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopInfo,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ToolUseContent,
)
from densa.openai.blocks import Block, BlockDelta, BlockEvent, BlockStart, BlockStream, whole_blocks
from densa.openai.errors import APIError
from densa.openai.framing import Framing
from densa.openai.reasoning import ReasoningSplitter
from densa.openai.responses import Generation
from densa.openai.tools.formats import ToolCallFormat
from densa.text.output import RequestOutput


@dataclass
class MessagesFormatter:
    message_id: str
    model: str
    # Set when the request offers tools: the answer is read for calls in this format.
    tool_format: ToolCallFormat | None = None
    # Set with --reasoning-parser: the reasoning becomes a first `thinking` block.
    reasoning: ReasoningSplitter | None = None
    _blocks: BlockStream = field(init=False)
    _kinds: list[str] = field(default_factory=list, init=False)  # each streamed block's kind
    _started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._blocks = BlockStream(self.tool_format, self.reasoning)

    def response(self, generation: Generation) -> Message:
        blocks = whole_blocks(self.tool_format, generation.text, self.reasoning)
        num_calls = sum(block.kind == "call" for block in blocks)
        stop = stop_info(generation.final, num_calls)
        return Message(
            id=self.message_id,
            model=self.model,
            content=[_content(block) for block in blocks],
            stop_reason=stop.stop_reason,
            stop_sequence=stop.stop_sequence,
            usage=usage_of(generation.final),
        )

    # ---- streaming (framing.StreamFormatter) -----------------------------------------------------
    def stream_start(self) -> list[BaseModel]:
        return []  # message_start carries the prompt's usage: it waits for the first output

    def stream_chunks(self, output: RequestOutput) -> list[BaseModel]:
        events: list[BaseModel] = [] if self._started else self._start(output)
        for event in self._blocks.feed(output.new_text, output.finished):
            events.append(self._event(event))
        if output.finished:
            events += [self.usage_chunk(output), MessageStop()]
        return events

    def usage_chunk(self, final: RequestOutput) -> BaseModel:
        """The message_delta that ends a stream: why it stopped, and the final usage."""
        return MessageDelta(delta=stop_info(final, self._blocks.num_calls), usage=usage_of(final))

    def _start(self, first: RequestOutput) -> list[BaseModel]:
        self._started = True
        message = Message(id=self.message_id, model=self.model, content=[], usage=usage_of(first))
        return [MessageStart(message=message), Ping()]

    def _event(self, event: BlockEvent) -> BaseModel:
        if isinstance(event, BlockStart):
            self._kinds.append(event.kind)
            block = Block(event.kind, call_id=event.call_id, name=event.name)
            return ContentBlockStart(index=event.index, content_block=_content(block, {}))
        if isinstance(event, BlockDelta):
            return ContentBlockDelta(
                index=event.index, delta=_delta(self._kinds[event.index], event.text)
            )
        return ContentBlockStop(index=event.index)


def _delta(kind: str, text: str) -> ThinkingDelta | TextDelta | InputJsonDelta:
    if kind == "reasoning":
        return ThinkingDelta(thinking=text)
    return TextDelta(text=text) if kind == "text" else InputJsonDelta(partial_json=text)


def _content(block: Block, tool_input: dict[str, Any] | None = None) -> ContentBlock:
    if block.kind == "reasoning":
        return ThinkingContent(thinking=block.text)
    if block.kind == "text":
        return TextContent(text=block.text)
    arguments = tool_input if tool_input is not None else _object_or_empty(block.text)
    return ToolUseContent(id=tool_use_id(block.call_id), name=block.name, input=arguments)


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a call id (`toolu_...`); any id the client sends back works."""
    return "toolu_" + call_id.removeprefix("call_")


def _object_or_empty(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_info(final: RequestOutput, num_calls: int) -> StopInfo:
    """Why the answer ended. A request the server dropped while draining ("abort") is a
    "pause_turn": the client may send the answer back to have it continued."""
    if final.stop_string is not None:
        return StopInfo(stop_reason="stop_sequence", stop_sequence=final.stop_string)
    if final.finish_reason == "length":
        return StopInfo(stop_reason="max_tokens")
    if final.finish_reason == "abort":
        return StopInfo(stop_reason="pause_turn")
    return StopInfo(stop_reason="tool_use" if num_calls else "end_turn")


def usage_of(output: RequestOutput) -> MessageUsage:
    return MessageUsage(
        input_tokens=output.num_prompt_tokens - output.num_cached_tokens,
        output_tokens=output.num_output_tokens,
        cache_read_input_tokens=output.num_cached_tokens,
    )


# ---- errors -------------------------------------------------------------------------------------
# Anthropic's error types by HTTP status; any other 4xx is an invalid request, any 5xx api_error.
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(error: APIError) -> ErrorBody:
    default = "api_error" if error.status_code >= 500 else "invalid_request_error"
    kind = _ERROR_TYPES.get(error.status_code, default)
    return ErrorBody(error=ErrorDetail(type=kind, message=error.info.message))


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error).model_dump()
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


# An Anthropic stream: named events, a failure as an `error` event, no terminator.
FRAMING = Framing(named=True, error_body=error_body, done="")
