"""How a response stream is shaped, per API: the formatter that turns engine outputs into events,
and the framing that writes them (serve/generation.py sends them as server-sent events)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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


@dataclass(frozen=True)
class Framing:
    """How a stream writes its events. OpenAI's chat and completions streams send bare `data:`
    chunks, a failure as `{"error": ...}`, and `[DONE]` last; Anthropic Messages and OpenAI
    Responses name every event after its body's `type` and need no terminator (their formatters
    write the last event)."""

    named: bool = False
    error_body: Callable[[APIError], BaseModel] = openai_error
    done: str = "data: [DONE]\n\n"


OPENAI_FRAMING = Framing()
