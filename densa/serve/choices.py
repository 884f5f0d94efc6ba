"""`n > 1`: several choices for one request, sharing the prompt's KV pages.

Each choice is an engine request of its own, with a formatter of its own (its own tool-call
parser and reasoning split). The first choice runs alone until its first token: by then the
prompt's full pages are in the prefix cache, so the other choices start from them and compute
only the prompt's last, partial page. A seeded request draws choice i from `seed + i`, so the
choices differ and each stays reproducible.

The response lists the choices by `index`; its usage counts the prompt once and the completion
tokens of every choice. Streamed, the choices' chunks interleave as their tokens come. A failure
of any choice fails the response (as one request would), and aborts the other choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from densa.engine.client import EngineClient
from densa.openai.errors import from_engine_output, timed_out
from densa.openai.framing import OPENAI_FRAMING, Framing, StreamFormatter
from densa.openai.protocol import PromptTokensDetails, Usage
from densa.openai.responses import Generation
from densa.sampling_params import SamplingParams
from densa.serve import generation
from densa.serve.generation import EngineCall, Outputs, SSEResponse
from densa.serve.tracking import RequestRecord
from densa.text.output import RequestOutput
from densa.text.tokenizer import Tokenizer

_SEED_SPAN = 2**64  # torch generators take seeds in [-2**63, 2**64)


class ChoiceFormatter(StreamFormatter, Protocol):
    def response(self, generation: Generation) -> BaseModel: ...


def choice_calls(call: EngineCall, n: int) -> list[EngineCall]:
    """The engine calls of n choices: ids `<id>`, `<id>-1`, ...; seeds `seed`, `seed + 1`, ..."""
    return [call] + [
        dataclasses.replace(call, request_id=f"{call.request_id}-{i}", params=_seed(call.params, i))
        for i in range(1, n)
    ]


def _seed(params: SamplingParams, offset: int) -> SamplingParams:
    if params.seed is None:
        return params  # unseeded requests draw from generators of their own already
    seed = params.seed + offset
    return dataclasses.replace(params, seed=seed - _SEED_SPAN if seed >= _SEED_SPAN else seed)


async def respond(
    request: Request,
    engine: EngineClient,
    tokenizer: Tokenizer,
    calls: Sequence[EngineCall],
    record: RequestRecord,
    new_formatter: Callable[[], ChoiceFormatter],
    stream: bool,
    include_usage: bool,
    framing: Framing = OPENAI_FRAMING,
) -> Response:
    """The n choices' response; `framing` (an API with a list of choices) writes its events."""
    assert framing.has_choices, "the caller refuses n > 1 for an API without choices"
    starts = await _start(request, engine, tokenizer, calls, record)
    formatters = [new_formatter() for _ in calls]
    if stream:
        events = _events(calls[0], record, starts, formatters, include_usage, framing)
        return SSEResponse(events)
    try:
        async with asyncio.timeout_at(calls[0].deadline):
            wholes = await generation.until_disconnected(
                request, asyncio.gather(*(generation.gather_outputs(record, *s) for s in starts))
            )
    except TimeoutError as exc:
        raise timed_out(calls[0].timeout) from exc
    finally:
        await _close(starts)
    _count(record, [whole.final for whole in wholes])
    responses = [f.response(whole) for f, whole in zip(formatters, wholes, strict=True)]
    body = _merged(responses, [whole.final for whole in wholes])
    return Response(body.model_dump_json(), media_type="application/json")


async def _start(
    request: Request,
    engine: EngineClient,
    tokenizer: Tokenizer,
    calls: Sequence[EngineCall],
    record: RequestRecord,
) -> list[tuple[RequestOutput, Outputs]]:
    """Start the first choice, and once its prompt is cached, the others; any refusal (429,
    503, ...) closes every started choice and is raised."""
    starts = [await generation.start(request, engine, tokenizer, calls[0], record)]
    try:
        results = await asyncio.gather(
            *(generation.start(request, engine, tokenizer, call, record) for call in calls[1:]),
            return_exceptions=True,
        )
    except BaseException:  # cancelled (the client left, the server stops): abort the first too
        await _close(starts)
        raise
    starts += [r for r in results if not isinstance(r, BaseException)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await _close(starts)
        raise failures[0]
    return starts


async def _close(starts: Sequence[tuple[RequestOutput, Outputs]]) -> None:
    for _, outputs in starts:
        await outputs.aclose()  # a finished one: nothing happens; else it is aborted


def _count(record: RequestRecord, finals: Sequence[RequestOutput]) -> None:
    """The record (log line, /metrics) counts as the usage does: the prompt once, with the
    tokens the cache held when the request came (the first choice's: the other choices find the
    prompt the first one cached, which is this request's own work, not a hit), and every
    choice's completion tokens. So cached never exceeds prompt (before: summed over choices)."""
    record.num_prompt_tokens = finals[0].num_prompt_tokens
    record.num_cached_tokens = finals[0].num_cached_tokens
    record.num_output_tokens = sum(final.num_output_tokens for final in finals)


def _usage(finals: Sequence[RequestOutput]) -> Usage:
    """The prompt once (as the first choice saw it), the completion tokens of every choice."""
    first = finals[0]
    completion = sum(final.num_output_tokens for final in finals)
    return Usage(
        prompt_tokens=first.num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=first.num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=first.num_cached_tokens),
    )


def _merged(responses: Sequence[Any], finals: Sequence[RequestOutput]) -> BaseModel:
    """One body (chat or completions alike) listing every choice, by index."""
    choices = [r.choices[0].model_copy(update={"index": i}) for i, r in enumerate(responses)]
    merged: BaseModel = responses[0].model_copy(
        update={"choices": choices, "usage": _usage(finals)}
    )
    return merged


async def _events(
    call: EngineCall,
    record: RequestRecord,
    starts: list[tuple[RequestOutput, Outputs]],
    formatters: Sequence[ChoiceFormatter],
    include_usage: bool,
    framing: Framing,
) -> AsyncGenerator[str, None]:
    """Each choice's chunks as its outputs come, then usage and the framing's end (as
    generation.sse_events writes one choice, through the same framing); a failure of any choice
    ends the stream with its error event."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()
    for i, (first, _) in enumerate(starts):  # each choice's first output before its others
        queue.put_nowait((i, first))
    pumps = [asyncio.ensure_future(_pump(i, out, queue)) for i, (_, out) in enumerate(starts)]
    finals: list[RequestOutput | None] = [None] * len(starts)
    latest = [first for first, _ in starts]  # each choice's newest output (cumulative counts)
    try:
        for i, formatter in enumerate(formatters):
            for event in framing.choice_events(formatter.stream_start(), i):
                yield event
        async for i, output in _take(queue, len(starts), call):
            record.observe(output)  # times; the counts are summed over the choices at the end
            latest[i] = output
            if output.finish_reason == "error":
                yield generation.error_event(record, from_engine_output(output), framing)
                return
            for event in framing.choice_events(formatters[i].stream_chunks(output), i):
                yield event
            if output.finished:
                finals[i] = output
        done = [final for final in finals if final is not None]
        if include_usage:
            usage = formatters[0].usage_chunk(done[0])
            yield framing.event(usage.model_copy(update={"usage": _usage(done)}))
        if framing.done:
            yield framing.done
    except TimeoutError:
        yield generation.error_event(record, timed_out(call.timeout), framing)
    finally:
        # Counted however the stream ends (an error, a client gone): the choices seen so far.
        _count(record, latest)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await _close(starts)


async def _pump(
    index: int, outputs: Outputs, queue: asyncio.Queue[tuple[int, RequestOutput | None]]
) -> None:
    """Outputs of one choice after its first (queued by the caller), then None: it is over."""
    try:
        async for output in outputs:
            queue.put_nowait((index, output))
    finally:
        queue.put_nowait((index, None))


async def _take(
    queue: asyncio.Queue[tuple[int, RequestOutput | None]], num_choices: int, call: EngineCall
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice, output) until every choice is over; TimeoutError past the call's deadline."""
    num_over = 0
    while num_over < num_choices:
        async with asyncio.timeout_at(call.deadline):
            index, output = await queue.get()
        if output is None:
            num_over += 1
        else:
            yield index, output
