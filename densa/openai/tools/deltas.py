"""Parser events as OpenAI chat deltas: content text and `tool_calls` pieces.

OpenAI streams a call as one delta with its index, id, type and name (arguments ""), then
deltas carrying only the index and the next arguments fragment. Events of one engine output
that belong to different calls or kinds become separate deltas, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from densa.openai.tools.models import FunctionCallDelta, ToolCallDelta
from densa.openai.tools.parser import CallArguments, CallStart, Content, Event


@dataclass(frozen=True)
class Delta:
    content: str | None = None
    tool_call: ToolCallDelta | None = None


def to_deltas(events: list[Event]) -> list[Delta]:
    deltas: list[Delta] = []
    for event in events:
        if isinstance(event, Content):
            if deltas and deltas[-1].content is not None:  # join adjacent text
                deltas[-1] = Delta(content=deltas[-1].content + event.text)
            else:
                deltas.append(Delta(content=event.text))
        elif isinstance(event, CallStart):
            start = ToolCallDelta(
                index=event.index,
                id=event.call_id,
                type="function",
                function=FunctionCallDelta(name=event.name, arguments=""),
            )
            deltas.append(Delta(tool_call=start))
        else:
            deltas.append(_arguments(deltas, event))
    return deltas


def _arguments(deltas: list[Delta], event: CallArguments) -> Delta:
    last = deltas[-1].tool_call if deltas else None
    if last is not None and last.index == event.index and last.id is None:
        deltas.pop()  # join adjacent fragments of one call into one delta
        assert last.function.arguments is not None
        event = CallArguments(event.index, last.function.arguments + event.text)
    return Delta(
        tool_call=ToolCallDelta(index=event.index, function=FunctionCallDelta(arguments=event.text))
    )
