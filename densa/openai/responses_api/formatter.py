"""Engine outputs as an OpenAI Responses response object, or as its stream of events.

Reasoning (with `--reasoning-parser`) becomes a first `reasoning` item, text a `message` output
item, each tool call a `function_call` item, in the order the model wrote them (openai/blocks.py).
A stream is

    response.created - response.in_progress
    reasoning:       output_item.added - reasoning_text.delta* - reasoning_text.done -
                     output_item.done
    per text block:  output_item.added - content_part.added - output_text.delta* -
                     output_text.done - content_part.done - output_item.done
    per call:        output_item.added - function_call_arguments.delta* -
                     function_call_arguments.done - output_item.done
    response.completed (or response.incomplete at max_output_tokens; response.failed on an error)

every event numbered by `sequence_number`, and its items are exactly the non-streamed answer's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from densa.openai.blocks import Block, BlockDelta, BlockEvent, BlockStart, BlockStream, whole_blocks
from densa.openai.errors import APIError
from densa.openai.framing import Framing
from densa.openai.reasoning import ReasoningSplitter
from densa.openai.responses import Generation
from densa.openai.responses_api.models import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    Event,
    FunctionCallOut,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    MessageOut,
    OutputItem,
    OutputItemEvent,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningOut,
    ReasoningTextOut,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
    TextOut,
)
from densa.openai.tools.formats import ToolCallFormat
from densa.text.output import RequestOutput


@dataclass
class _Item:
    """A streamed output item: its block so far and its id."""

    block: Block
    item_id: str


@dataclass
class ResponseFormatter:
    # The response object without its outcome: id, model, creation time and the echoed request.
    skeleton: ResponseObject
    # Set when the request offers tools: the answer is read for calls in this format.
    tool_format: ToolCallFormat | None = None
    # Set with --reasoning-parser: the reasoning becomes a first `reasoning` item.
    reasoning: ReasoningSplitter | None = None
    _blocks: BlockStream = field(init=False)
    _items: list[_Item] = field(default_factory=list, init=False)
    _num_events: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._blocks = BlockStream(self.tool_format, self.reasoning)

    def response(self, generation: Generation) -> ResponseObject:
        blocks = whole_blocks(self.tool_format, generation.text, self.reasoning)
        items = [_Item(block, _item_id(block)) for block in blocks]
        return self._finished(generation.final, _final_outputs(items, generation.final))

    # ---- streaming (framing.StreamFormatter) -----------------------------------------------------
    def stream_start(self) -> list[BaseModel]:
        return [
            self._event(ResponseEvent, type=f"response.{kind}", response=self.skeleton)
            for kind in ("created", "in_progress")
        ]

    def stream_chunks(self, output: RequestOutput) -> list[BaseModel]:
        events: list[BaseModel] = []
        for event in self._blocks.feed(output.new_text, output.finished):
            events += self._block_events(event, output)
        if output.finished:
            events.append(self.usage_chunk(output))
        return events

    def usage_chunk(self, final: RequestOutput) -> BaseModel:
        """The event that ends a stream: the whole response, with its status and usage."""
        response = self._finished(final, _final_outputs(self._items, final))
        return self._event(ResponseEvent, type=f"response.{response.status}", response=response)

    def failed(self, error: APIError) -> BaseModel:
        """The event that ends a stream the engine failed (framing.Framing.error_body)."""
        failure = ResponseError(code=error.info.code or "server_error", message=error.info.message)
        response = self.skeleton.model_copy(update={"status": "failed", "error": failure})
        return self._event(ResponseEvent, type="response.failed", response=response)

    @property
    def framing(self) -> Framing:
        return Framing(named=True, error_body=self.failed, done="")

    # ---- block events -> Responses events ------------------------------------------------------
    def _block_events(self, event: BlockEvent, output: RequestOutput) -> list[BaseModel]:
        if isinstance(event, BlockStart):
            block = Block(event.kind, call_id=event.call_id, name=event.name)
            self._items.append(_Item(block, _item_id(block)))
            return self._item_added(event.index)
        item = self._items[event.index]
        if isinstance(event, BlockDelta):
            item.block.text += event.text
            return [self._delta(event.index, event.text)]
        is_last = output.finished and event.index == len(self._items) - 1
        return self._item_done(event.index, _item_status(output) if is_last else "completed")

    def _item_added(self, idx: int) -> list[BaseModel]:
        item = self._items[idx]
        events = [self._item_event("added", idx, _output(item, "in_progress"))]
        if item.block.kind == "text":
            events.append(self._part_event("added", idx, TextOut(text="")))
        return events

    def _delta(self, idx: int, text: str) -> BaseModel:
        item_id, kind = self._items[idx].item_id, self._items[idx].block.kind
        event = _DELTA_EVENTS[kind]
        return self._event(event, item_id=item_id, output_index=idx, delta=text)

    def _item_done(self, idx: int, status: ItemStatus) -> list[BaseModel]:
        item = self._items[idx]
        block, item_id = item.block, item.item_id
        if block.kind == "reasoning":
            events = [
                self._event(ReasoningDoneEvent, item_id=item_id, output_index=idx, text=block.text)
            ]
        elif block.kind == "text":
            events = [
                self._event(TextDoneEvent, item_id=item_id, output_index=idx, text=block.text),
                self._part_event("done", idx, TextOut(text=block.text)),
            ]
        else:
            events = [
                self._event(
                    ArgumentsDoneEvent,
                    item_id=item_id,
                    output_index=idx,
                    name=block.name,
                    arguments=block.text,
                )
            ]
        return [*events, self._item_event("done", idx, _output(item, status))]

    def _item_event(self, kind: str, idx: int, item: OutputItem) -> BaseModel:
        event_type = f"response.output_item.{kind}"
        return self._event(OutputItemEvent, type=event_type, output_index=idx, item=item)

    def _part_event(self, kind: str, idx: int, part: TextOut) -> BaseModel:
        item_id = self._items[idx].item_id
        event_type = f"response.content_part.{kind}"
        return self._event(
            ContentPartEvent, type=event_type, item_id=item_id, output_index=idx, part=part
        )

    def _event(self, model: type[Event], **fields: Any) -> BaseModel:
        event = model(sequence_number=self._num_events, **fields)
        self._num_events += 1
        return event

    def _finished(self, final: RequestOutput, output: list[OutputItem]) -> ResponseObject:
        outcome: dict[str, Any] = {"status": "completed", "incomplete_details": None}
        if final.finish_reason == "length":
            outcome = {"status": "incomplete", "incomplete_details": _CUT_AT_MAX_TOKENS}
        elif final.finish_reason == "abort":  # dropped while the server drained
            outcome = {"status": "incomplete", "incomplete_details": IncompleteDetails(reason=None)}
        return self.skeleton.model_copy(
            update={**outcome, "output": output, "usage": usage_of(final)}
        )


_CUT_AT_MAX_TOKENS = IncompleteDetails(reason="max_output_tokens")
_DELTA_EVENTS: dict[str, type[Event]] = {
    "reasoning": ReasoningDeltaEvent,
    "text": TextDeltaEvent,
    "call": ArgumentsDeltaEvent,
}
_ITEM_ID_PREFIXES = {"reasoning": "rs_", "text": "msg_", "call": "fc_"}


def skeleton_of(response_id: str, created_at: int, request: ResponsesRequest) -> ResponseObject:
    """The response in progress: what it echoes of its request, no output yet."""
    text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else None
    return ResponseObject(
        id=response_id,
        created_at=created_at,
        status="in_progress",
        model=request.model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        temperature=request.temperature,
        top_p=request.top_p,
        tool_choice=_dump(request.tool_choice) if request.tool_choice is not None else "auto",
        tools=[_dump(tool) for tool in request.tools or []],
        text=text or {"format": {"type": "text"}},
        metadata=request.metadata or {},
        user=request.user,
    )


def _dump(value: Any) -> Any:
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value


def _item_id(block: Block) -> str:
    return _ITEM_ID_PREFIXES[block.kind] + uuid.uuid4().hex


def _output(item: _Item, status: ItemStatus) -> OutputItem:
    block = item.block
    if block.kind == "reasoning":
        thought = [ReasoningTextOut(text=block.text)] if status != "in_progress" else []
        return ReasoningOut(id=item.item_id, status=status, content=thought)
    if block.kind == "text":
        text = [TextOut(text=block.text)] if status != "in_progress" else []
        return MessageOut(id=item.item_id, status=status, content=text)
    arguments = block.text if status != "in_progress" else ""
    return FunctionCallOut(
        id=item.item_id, call_id=block.call_id, name=block.name, arguments=arguments, status=status
    )


def _final_outputs(items: list[_Item], final: RequestOutput) -> list[OutputItem]:
    """The items of a finished answer: complete, but for the last, which ends with the answer."""
    last = len(items) - 1
    return [
        _output(item, _item_status(final) if idx == last else "completed")
        for idx, item in enumerate(items)
    ]


def _item_status(final: RequestOutput) -> ItemStatus:
    """The status of the item the answer ended in (every earlier one is complete)."""
    return "incomplete" if final.finish_reason in ("length", "abort") else "completed"


def usage_of(final: RequestOutput) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=final.num_prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
        output_tokens=final.num_output_tokens,
        total_tokens=final.num_prompt_tokens + final.num_output_tokens,
    )
