"""One HTTP request on the engine: start it, then gather it whole or stream it as SSE.

The engine (behind EngineClient) streams token deltas; `text_outputs` turns them into text here,
in the front, per request (text/output.TextStream): detokenization and stop strings run beside
the engine's forward pass, not in it. A stop string ends the request here and aborts it in the
engine; a failure to detokenize ends this request alone.

Starting waits for the first output, so that refusals (overload, shutdown, a prompt that can
never run) still become proper HTTP statuses instead of an error inside a 200 stream. From then on,
a client that goes away cancels the iteration, and leaving `EngineClient.generate` aborts the
request, which frees its KV pages. A request past its deadline (`--request-timeout`) is left the
same way, so it is aborted too, and the client gets a `request_timeout` error.

Every output is also shown to the request's `RequestRecord` (timings and token counts for the
log line and /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from densa.engine.client import (
    EngineClient,
    EngineOverloaded,
    EngineShuttingDown,
    EngineUnavailable,
)
from densa.ipc.messages import AddRequest
from densa.openai.errors import (
    APIError,
    ClientDisconnected,
    bad_request,
    engine_unavailable,
    from_engine_output,
    overloaded,
    shutting_down,
    timed_out,
)
from densa.openai.framing import OPENAI_FRAMING, Framing, StreamFormatter
from densa.openai.responses import Generation
from densa.sampling_params import SamplingParams
from densa.serve.tracking import RequestRecord
from densa.text.output import RequestOutput, TextStream, error_output
from densa.text.tokenizer import Tokenizer
from densa.utils.logging import get_logger

T = TypeVar("T")
Outputs = AsyncGenerator[RequestOutput, None]
logger = get_logger(__name__)
DETOKENIZE_ERROR = (
    "engine_error: internal error while detokenizing this request; it was ended alone"
)


@dataclass(frozen=True)
class EngineCall:
    """Everything the engine needs for one request, and how long it may take."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_scope: str = ""
    session_id: str | None = None
    timeout: float | None = None  # seconds the whole request may take (None: no limit)
    deadline: float | None = None  # the same as an event-loop time (asyncio.timeout_at)
    prefill_address: str = ""  # a decode worker: the prefill worker's KV address ("" = here)
    # echo with max_tokens=0: the engine samples one token (it always does); it is dropped here,
    # so the response, the log line and /metrics see none.
    prompt_only: bool = False


async def text_outputs(
    engine: EngineClient, tokenizer: Tokenizer, call: EngineCall
) -> AsyncGenerator[RequestOutput, None]:
    """The request's text outputs, until the final one. Leaving early (or a stop string) aborts
    the engine request."""
    stream = TextStream(tokenizer, call.request_id, call.prompt_token_ids, call.params)
    request = AddRequest(
        call.request_id, call.prompt_token_ids, call.params, call.cache_scope, call.session_id,
        call.prefill_address,
    )  # fmt: skip
    async with contextlib.aclosing(engine.generate(request)) as deltas:
        async for delta in deltas:
            try:
                output = stream.process(delta)
            except Exception:  # this request's text alone is broken: end it, nobody else
                logger.exception("detokenizing request %s failed; ending it", call.request_id)
                yield error_output(call.request_id, DETOKENIZE_ERROR, "engine_error")
                return
            if output is None:
                continue
            if call.prompt_only:
                output = _without_tokens(output)
            yield output
            if output.finished:
                return  # a stop string finished it: closing `deltas` aborts it in the engine


def _without_tokens(output: RequestOutput) -> RequestOutput:
    """The output of a prompt-only call: its prompt logprobs and counts, no generated token."""
    reason = "length" if output.finish_reason in ("stop", "length") else output.finish_reason
    return dataclasses.replace(
        output, new_token_ids=[], new_text="", new_logprobs=[], num_output_tokens=0,
        finish_reason=reason, stop_string=None, text="" if output.finished else None,
        token_ids=[] if output.finished else None,
    )  # fmt: skip


async def start(
    request: Request,
    engine: EngineClient,
    tokenizer: Tokenizer,
    call: EngineCall,
    record: RequestRecord,
) -> tuple[RequestOutput, Outputs]:
    """Submit the request and wait for its first output; raise APIError if it is refused."""
    outputs = text_outputs(engine, tokenizer, call)
    try:
        async with asyncio.timeout_at(call.deadline):
            first = await until_disconnected(request, anext(outputs))
    except TimeoutError as exc:  # still queued, or a long prefill: the request is aborted
        await outputs.aclose()
        raise timed_out(call.timeout) from exc
    except EngineOverloaded as exc:
        raise overloaded(str(exc)) from exc
    except EngineShuttingDown as exc:
        raise shutting_down() from exc
    except EngineUnavailable as exc:
        raise engine_unavailable(str(exc)) from exc
    except ValueError as exc:  # a request id already in use
        raise bad_request(str(exc)) from exc
    record.observe(first)
    if first.finish_reason == "error":
        await outputs.aclose()
        raise from_engine_output(first)
    return first, outputs


async def collect(
    request: Request,
    call: EngineCall,
    record: RequestRecord,
    first: RequestOutput,
    outputs: Outputs,
) -> Generation:
    """Gather every output into one Generation; raise APIError if the engine failed the request,
    the client went away (ClientDisconnected) or the deadline passed."""
    try:
        async with asyncio.timeout_at(call.deadline):
            return await until_disconnected(request, _gather(record, first, outputs))
    except TimeoutError as exc:
        raise timed_out(call.timeout) from exc


async def _gather(record: RequestRecord, first: RequestOutput, outputs: Outputs) -> Generation:
    async with contextlib.aclosing(outputs):
        return await gather_outputs(record, first, outputs)


async def gather_outputs(
    record: RequestRecord, first: RequestOutput, outputs: Outputs
) -> Generation:
    """One request's outputs as one Generation (the caller closes `outputs`); raise APIError if
    the engine failed the request."""
    texts, logprobs, final = [first.new_text], list(first.new_logprobs), first
    prompt_logprobs = list(first.prompt_logprobs)
    async for output in outputs:
        record.observe(output)  # n > 1: the counts are summed over the choices at the end
        texts.append(output.new_text)
        logprobs.extend(output.new_logprobs)
        prompt_logprobs.extend(output.prompt_logprobs)
        final = output
    if final.finish_reason == "error":
        raise from_engine_output(final)
    return Generation("".join(texts), logprobs, final, prompt_logprobs)


async def sse_events(
    call: EngineCall,
    record: RequestRecord,
    first: RequestOutput,
    outputs: Outputs,
    formatter: StreamFormatter,
    include_usage: bool,
    framing: Framing = OPENAI_FRAMING,
) -> AsyncGenerator[str, None]:
    """`data: {chunk}` events, then a usage chunk if asked for, then `data: [DONE]`.

    A failure mid-stream (engine error, deadline) sends `data: {"error": ...}` and ends the stream
    without [DONE] (the status line is long gone), which the OpenAI clients raise as an error.
    Another `framing` names the events and writes the failure (and the end) its own way.
    """
    async with contextlib.aclosing(outputs):
        for chunk in formatter.stream_start():
            yield framing.event(chunk)
        output = first
        while True:
            if output.finish_reason == "error":
                yield error_event(record, from_engine_output(output), framing)
                return
            for body in formatter.stream_chunks(output):
                yield framing.event(body)
            if output.finished:
                break
            try:
                async with asyncio.timeout_at(call.deadline):
                    output = await anext(outputs)
            except TimeoutError:  # leaving the `async with` aborts the request
                yield error_event(record, timed_out(call.timeout), framing)
                return
            record.observe(output)
        if include_usage:
            yield framing.event(formatter.usage_chunk(output))
        if framing.done:
            yield framing.done


def error_event(record: RequestRecord, error: APIError, framing: Framing) -> str:
    """The framing's failure event; the record keeps the code (log line, /metrics)."""
    record.error_code = error.info.code
    return framing.error_event(error)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its event generator however the response ends.

    Starlette cancels the stream when the client disconnects; if that lands while the generator is
    parked at a `yield`, nothing would close it until garbage collection. Closing it here aborts
    the engine request at once.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, but cancel it and raise ClientDisconnected if the client goes away first.

    Without this a non-streaming request keeps generating for nobody: the handler is not cancelled
    when the connection drops before the response starts.
    """
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # e.g. a deadline: stop the work before passing it on, so
        work.cancel()  # the engine stream is closed (and the request aborted) by then
        watcher.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)  # let the engine stream's cleanup run
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
