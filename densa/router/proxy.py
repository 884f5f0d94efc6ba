"""Forwarding one request to the worker the router chose, and its answer back, untouched.

Retries: an attempt moves to another worker only while no byte has reached the client -- the
connection failed, the worker answered 503 (it cannot take requests now), or it died before the
first byte of its answer. A non-streamed answer is read whole before the client sees anything, so
a worker that dies mid-answer is retried too. A stream is relayed chunk by chunk as the client
reads it (each chunk is pulled from the worker only after the previous one was sent, so a slow
client slows the worker's socket, not the router's memory); a worker lost mid-stream ends the
stream with an explicit `data: {"error": ...}` event, as a worker's own failures do.
Every other status -- 4xx, 429, 500 -- is passed through as the worker wrote it.

Headers (docs/routing.md): the client's go on, except hop-by-hop ones and every `x-densa-*`
header, which only the router writes: on a prefill + decode pair it names the prefill worker
(`x-densa-prefill`) with a placement token it signed (`x-densa-placement`). A worker's answer
goes back without its `x-densa-*` headers; the router's own (the worker's URL, its own time)
only with `--debug-headers`.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from starlette.datastructures import Headers
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from densa.auth.placement import PLACEMENT_HEADER, sign_placement
from densa.auth.secret import ClusterSecret
from densa.openai.errors import APIError
from densa.router.incoming import Incoming
from densa.router.metrics import RouterMetrics
from densa.router.routing import Placement, Router
from densa.utils.logging import get_logger

request_log = get_logger("densa.router.requests")

WORKER_HEADER = "x-densa-worker"
PREFILL_HEADER = "x-densa-prefill"
DECISION_HEADER = "x-densa-router-ms"  # the router's own time on the request before forwarding
INTERNAL_PREFIX = "x-densa-"  # headers of the internal plane: no client may send them on
# Hop-by-hop headers describe one connection, not the message (RFC 9110 7.6.1); lengths are
# recomputed for each side.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "te", "trailer", "transfer-encoding", "upgrade", "host",
                         "content-length"})  # fmt: skip
# The router's own server writes these on every response: the worker's copies would repeat them.
_ROUTER_OWN = frozenset({"date", "server"})
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


class _Retry(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def no_worker_available() -> APIError:
    message = "no worker can take this request right now; retry shortly"
    return APIError(503, message, "no_worker_available", error_type="server_error",
                    headers={"Retry-After": "1"})  # fmt: skip


@dataclass
class Proxy:
    """Requests go to the workers through `transport` itself, not through an httpx client: a
    client's per-request work (merging its URL, headers, cookies and params, auth and redirect
    handling, a log record) cost the router's hop about as much as its scoring (0.4-0.6 ms of
    ~2.3 ms added to a tiny request on the 2-core development machine), and its cookie jar
    would keep a worker's Set-Cookie and send it on with every later client's request."""

    router: Router
    client: httpx.AsyncClient  # polls and /v1/models (over the same transport)
    transport: httpx.AsyncBaseTransport
    timeout: httpx.Timeout
    metrics: RouterMetrics
    max_attempts: int = 3
    secret: ClusterSecret | None = field(default=None, repr=False)  # signs P/D placements
    debug_headers: bool = False

    def __post_init__(self) -> None:
        self._timeout = self.timeout.as_dict()  # the form a transport reads from extensions

    async def forward(self, incoming: Incoming, headers: Headers, arrived: float) -> Response:
        tried: set[str] = set()
        while len(tried) < self.max_attempts:
            placement = self.router.place(incoming, frozenset(tried))
            if placement is None:
                break
            try:
                return await self._attempt(placement, incoming, headers, arrived, len(tried) + 1)
            except _Retry as retry:
                tried.add(placement.worker.url)
                self.metrics.count_retry(retry.reason)
        self.metrics.no_worker.inc()
        request_log.info("POST %s -> no worker (tried %s)", incoming.endpoint, sorted(tried))
        return no_worker_available().to_response()

    async def _attempt(
        self, placement: Placement, incoming: Incoming, headers: Headers, arrived: float,
        attempt: int,
    ) -> Response:  # fmt: skip
        worker = placement.worker
        decision_ms = (time.perf_counter() - arrived) * 1000
        if attempt == 1:
            self.metrics.decision_seconds.observe(decision_ms / 1000)
        self.router.opened(placement)
        done = _Once(lambda n: self.router.closed(placement, n))
        request = httpx.Request(
            "POST", worker.endpoint(incoming.endpoint), content=incoming.body,
            headers=self._upstream_headers(headers, placement),
            extensions={"timeout": self._timeout},
        )  # fmt: skip
        try:
            upstream = await self.transport.handle_async_request(request)
        except httpx.TransportError as exc:
            done(None)
            self.router.pool.report_failure(worker, "connect", type(exc).__name__)
            raise _Retry("connect") from exc
        if upstream.status_code == 503:  # draining or restarting: another worker may take it
            await upstream.aclose()
            done(None)
            raise _Retry("worker_unavailable")
        out_headers = self._downstream_headers(upstream.headers, placement, decision_ms)
        self._log(incoming, placement, upstream.status_code, attempt, decision_ms)
        self.metrics.count_response(worker.url, upstream.status_code)
        if incoming.stream and upstream.status_code == 200:
            return await self._stream(upstream, placement, done, out_headers)
        content = await self._read_whole(upstream, placement, done)
        done(_completion_tokens(content) if upstream.status_code == 200 else None)
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    async def _read_whole(
        self, upstream: httpx.Response, placement: Placement, done: _Once
    ) -> bytes:
        try:
            return b"".join([chunk async for chunk in upstream.aiter_raw()])
        except httpx.TransportError as exc:
            done(None)
            self.router.pool.report_failure(placement.worker, "lost_before_answer",
                                            type(exc).__name__)  # fmt: skip
            raise _Retry("lost_before_answer") from exc
        finally:
            await upstream.aclose()

    async def _stream(
        self, upstream: httpx.Response, placement: Placement, done: _Once,
        headers: dict[str, str],
    ) -> Response:  # fmt: skip
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks)
        except (httpx.TransportError, StopAsyncIteration) as exc:
            await upstream.aclose()
            done(None)
            self.router.pool.report_failure(placement.worker, "lost_before_answer")
            raise _Retry("lost_before_answer") from exc
        return _ClosingStream(self._relay(first, chunks, upstream, placement, done), headers)

    async def _relay(
        self, first: bytes, chunks: AsyncIterator[bytes], upstream: httpx.Response,
        placement: Placement, done: _Once,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        counter = _StreamCounter()
        try:
            counter.see(first)
            yield first
            async for chunk in chunks:
                counter.see(chunk)
                yield chunk
        except httpx.TransportError as exc:  # bytes already sent: no retry, an explicit error
            self.router.pool.report_failure(placement.worker, "lost_mid_stream",
                                            type(exc).__name__)  # fmt: skip
            request_log.warning("stream from %s lost mid-answer (%s)", placement.worker.url,
                                type(exc).__name__)  # fmt: skip
            yield _WORKER_LOST_EVENT
        finally:
            await upstream.aclose()
            done(counter.num_output_tokens())

    @staticmethod
    def _log(
        incoming: Incoming, placement: Placement, status: int, attempt: int, decision_ms: float
    ) -> None:
        prefill = f" prefill={placement.prefill.url}" if placement.prefill else ""
        # The session id is the client's text: escaped and cut, so it cannot forge log lines.
        session = ascii(incoming.session_id[:64]) if incoming.session_id else "-"
        request_log.info(
            "POST %s -> %s%s status=%d signal=%s attempt=%d decide_ms=%.2f session=%s",
            incoming.endpoint, placement.worker.url, prefill, status, placement.decision.signal,
            attempt, decision_ms, session,
        )  # fmt: skip

    def _upstream_headers(self, headers: Headers, placement: Placement) -> dict[str, str]:
        out = {k: v for k, v in headers.items() if not _is_dropped(k)}
        if placement.prefill is not None:
            # RouterConfig refuses a decode pool without a secret, so a pair always has one.
            assert self.secret is not None, "a prefill + decode placement needs the secret"
            out[PREFILL_HEADER] = placement.prefill.url
            out[PLACEMENT_HEADER] = sign_placement(self.secret, placement.prefill.url)
        return out

    def _downstream_headers(
        self, headers: httpx.Headers, placement: Placement, decision_ms: float
    ) -> dict[str, str]:
        out = {k: v for k, v in headers.items()
               if not _is_dropped(k) and k.lower() not in _ROUTER_OWN}  # fmt: skip
        if self.debug_headers:
            out[WORKER_HEADER] = placement.worker.url
            if placement.prefill is not None:
                out[PREFILL_HEADER] = placement.prefill.url
            out[DECISION_HEADER] = f"{decision_ms:.3f}"
        return out


class _Once:
    """Calls `action` the first time only (a request is closed exactly once, however it ends)."""

    def __init__(self, action: Callable[[int | None], None]) -> None:
        self._action: Callable[[int | None], None] | None = action

    def __call__(self, num_output_tokens: int | None) -> None:
        action, self._action = self._action, None
        if action is not None:
            action(num_output_tokens)


class _StreamCounter:
    """Output tokens of a relayed stream: its usage chunk if it has one, else its events."""

    def __init__(self) -> None:
        self._num_events = 0
        self._tail = b""

    def see(self, chunk: bytes) -> None:
        self._num_events += chunk.count(b"data: {")
        self._tail = (self._tail + chunk)[-2048:]

    def num_output_tokens(self) -> int | None:
        found = _COMPLETION_TOKENS.findall(self._tail)
        if found:
            return int(found[-1])
        return max(self._num_events - 1, 0) if self._num_events else None


def _completion_tokens(content: bytes) -> int | None:
    found = _COMPLETION_TOKENS.findall(content[-4096:])
    return int(found[-1]) if found else None


# Names no worker: the workers' addresses are the internal plane's (only --debug-headers shows
# them); the router's log says which one it was.
_WORKER_LOST_EVENT = b"data: " + json.dumps({"error": {
    "message": "the worker serving this stream was lost; retry the request",
    "type": "server_error", "param": None, "code": "worker_lost"}}).encode() + b"\n\n"  # fmt: skip


def _is_dropped(name: str) -> bool:
    """Hop-by-hop, or the internal plane's (x-densa-*, whoever sent it)."""
    name = name.lower()
    return name in _HOP_BY_HOP or name.startswith(INTERNAL_PREFIX)


class _ClosingStream(StreamingResponse):
    """A relayed stream that closes its generator however the response ends (a client that
    disconnects cancels the response; the generator then closes the worker's stream at once
    instead of at garbage collection)."""

    def __init__(self, relay: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(relay, status_code=200, headers=headers)
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self._relay.aclose()  # type: ignore[attr-defined]
