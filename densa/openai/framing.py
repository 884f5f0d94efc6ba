"""How a response stream is shaped, per API: the formatter that turns engine outputs into events,
and the framing that writes them (serve/generation.py sends them as server-sent events, one
choice or, serve/choices.py, several)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from densa.openai.errors import APIError, ErrorResponse
from densa.text.output import RequestOutput


class StreamFormatter(Protocol):
    """Turns engine outputs into stream chunks (see responses.ChatFormatter)."""

    def stream_start(self) -> list[BaseModel]: ...

    def stream_chunks(self, output: RequestOutput) -> list[BaseModel]: ...

    def usage_chunk(self, final: RequestOutput) -> BaseModel: ...


def openai_error(error: APIError) -> BaseModel:
    return ErrorResponse(error=error.info)


def index_openai_choice(chunk: Any, index: int) -> BaseModel:
    """A chat or completions chunk, said to be choice `index`'s (n > 1)."""
    for choice in chunk.choices:
        choice.index = index
    result: BaseModel = chunk
    return result


@dataclass(frozen=True)
class Framing:
    """How a stream writes its events. OpenAI's chat and completions streams send bare `data:`
    chunks, a failure as `{"error": ...}`, and `[DONE]` last; Anthropic Messages and OpenAI
    Responses name every event after its body's `type` and need no terminator (their formatters
    write the last event). Every stream writer, of one choice or several, writes through these."""

    named: bool = False
    error_body: Callable[[APIError], BaseModel] = openai_error
    done: str = "data: [DONE]\n\n"
    # How a chunk says which of several choices (n > 1) it belongs to. None: the API has no
    # list of choices (Anthropic Messages, Responses), so a request for several is refused.
    index_choice: Callable[[BaseModel, int], BaseModel] | None = None

    @property
    def has_choices(self) -> bool:
        return self.index_choice is not None

    def event(self, body: BaseModel) -> str:
        """One server-sent event: `data: {body}`, named after the body's `type` if `named`."""
        data = f"data: {body.model_dump_json()}\n\n"
        if not self.named:
            return data
        name = getattr(body, "type", None)
        assert isinstance(name, str), "a named event's body has a `type`: its name"
        return f"event: {name}\n{data}"

    def error_event(self, error: APIError) -> str:
        """The event that ends a stream that failed after its status line was sent."""
        return self.event(self.error_body(error))

    def choice_events(self, chunks: list[BaseModel], index: int) -> list[str]:
        """Choice `index`'s chunks as events (n > 1)."""
        assert self.index_choice is not None, "only an API with a list of choices streams several"
        return [self.event(self.index_choice(chunk, index)) for chunk in chunks]


OPENAI_FRAMING = Framing(index_choice=index_openai_choice)
