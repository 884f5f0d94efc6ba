"""Per-request records: what happened to each generation request, from arrival to the last byte.

`RequestTracking` (ASGI middleware) opens a `RequestRecord` for every generation request, before
anything can fail, and closes it once the response is fully sent or the client is gone -- so every
request is counted exactly once, whatever its outcome (a 413 on the body, a 429, a finished stream,
a client that disconnected mid-stream). The routes and error handlers fill the record in; closing
it logs one structured line and updates the metrics.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from densa.openai.headers import IGNORED_FIELDS_HEADER, SESSION_HEADER
from densa.openai.unknown_fields import header_value
from densa.text.output import RequestOutput
from densa.utils.logging import get_logger

logger = get_logger("densa.requests")

REQUEST_ID_HEADER = "x-request-id"
# Generation endpoints -> the prefix of their request ids (OpenAI's spelling).
TRACKED_ENDPOINTS = {
    "/v1/chat/completions": "chatcmpl",
    "/v1/completions": "cmpl",
    "/v1/messages": "msg",  # Anthropic Messages
    "/v1/responses": "resp",  # OpenAI Responses
    "/infill": "infill",  # llama.cpp's fill-in-the-middle
}
_STATE_KEY = "densa_record"
# The outcome of a request whose client went away before it finished.
CLIENT_CLOSED = "client_closed"


@dataclass
class RequestRecord:
    """One generation request. Times are time.monotonic() seconds."""

    request_id: str
    endpoint: str
    session_id: str | None = None  # x-session-affinity, else the body's prompt_cache_key
    session_header: str | None = None  # x-session-affinity as sent (echoed back as a header)
    safety_identifier: str | None = None  # the client's end-user id for abuse tracing (logged)
    ignored_fields: list[str] = field(default_factory=list)  # request fields that were ignored
    arrival_time: float = field(default_factory=time.monotonic)
    status: int | None = None  # the HTTP status sent (200 for a stream, even one that failed)
    error_code: str | None = None  # set for any error, before or during the response
    finish_reason: str | None = None  # set when the engine finished the request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # tokens handed to the response so far
    first_token_time: float | None = None
    last_token_time: float | None = None
    end_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        """Take in one engine output (counts are cumulative, so the last one seen wins)."""
        now = time.monotonic()
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        self.num_output_tokens = output.num_output_tokens
        if output.new_token_ids:
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        if output.finished:
            self.finish_reason = output.finish_reason
            if output.finish_reason == "error":
                self.error_code = output.error_code or "engine_error"

    @property
    def is_admitted(self) -> bool:
        """Did the engine take the request (it reported prompt tokens)?"""
        return self.num_prompt_tokens > 0

    @property
    def outcome(self) -> str:
        """The error code, else the finish reason, else `client_closed` (nobody to answer)."""
        return self.error_code or self.finish_reason or CLIENT_CLOSED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return (self.end_time or time.monotonic()) - self.arrival_time

    def log_line(self) -> str:
        """One logfmt line: easy to grep, and to parse for a router or a log pipeline."""
        fields = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "status": self.status,
            "outcome": self.outcome,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": self.num_cached_tokens,
            "completion_tokens": self.num_output_tokens,
            "ttft_ms": _ms(self.ttft_s),
            "tpot_ms": _ms(self.tpot_s),
            "e2e_ms": _ms(self.e2e_s),
            "session": self.session_id,
            "safety_identifier": self.safety_identifier,
        }
        return "request finished " + " ".join(
            f"{key}={_logfmt(value)}" for key, value in fields.items() if value is not None
        )


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds * 1000:.1f}"


def _logfmt(value: object) -> str:
    text = str(value)
    if text and text.isascii() and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    # Quoted, with backslashes, control and non-ASCII characters escaped: one line, always.
    escaped = text.encode("unicode_escape").decode("ascii").replace('"', '\\"')
    return f'"{escaped}"'


def record_of(request: Request) -> RequestRecord | None:
    """The record the middleware opened for this request (None for untracked endpoints)."""
    record = request.scope.get("state", {}).get(_STATE_KEY)
    return record if isinstance(record, RequestRecord) else None


def note_error(request: Request, code: str | None) -> None:
    """Remember why a tracked request failed (called by the error handlers)."""
    record = record_of(request)
    if record is not None:
        record.error_code = code or "error"


class RequestTracking:
    """ASGI middleware: open a record per generation request, close it after the last byte."""

    def __init__(
        self,
        app: ASGIApp,
        on_started: Callable[[RequestRecord], None],
        on_finished: Callable[[RequestRecord], None],
    ) -> None:
        self.app = app
        self.on_started = on_started
        self.on_finished = on_finished

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        prefix = TRACKED_ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if prefix is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(f"{prefix}-{uuid.uuid4().hex}", scope["path"])
        record.session_id = record.session_header = _header(scope, SESSION_HEADER)
        scope.setdefault("state", {})[_STATE_KEY] = record
        self.on_started(record)

        async def send_tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message["headers"] = [*message.get("headers", []), *_echo_headers(record)]
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        except Exception:  # not CancelledError: a client that went away is no server error
            record.status = record.status or 500
            record.error_code = record.error_code or "internal_error"
            raise
        finally:
            record.end_time = time.monotonic()
            self.on_finished(record)


def _header(scope: Scope, name: str) -> str | None:
    wanted = name.encode("latin-1")
    for key, value in scope.get("headers", []):
        if key.lower() == wanted:
            return bytes(value).decode("latin-1")
    return None


def _echo_headers(record: RequestRecord) -> list[tuple[bytes, bytes]]:
    """The request id on every response; the session id back so a router can see the binding."""
    headers = [(REQUEST_ID_HEADER.encode(), record.request_id.encode())]
    if record.session_header is not None:
        headers.append((SESSION_HEADER.encode(), record.session_header.encode("latin-1")))
    if record.ignored_fields:
        value = header_value(record.ignored_fields)
        headers.append((IGNORED_FIELDS_HEADER.encode(), value.encode("ascii")))
    return headers
