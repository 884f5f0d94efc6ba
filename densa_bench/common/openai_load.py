"""One load generator for every OpenAI-compatible server: the official `openai` client, streaming.

A wave sends `len(prompts)` /v1/completions requests at once (one asyncio task each), reads every
streamed event and stamps its arrival; the request's output token count comes from the server's
own usage report (`stream_options.include_usage`), so engines that pack several tokens into one
event are counted right. Whatever engine is behind the URL gets exactly the same client code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from densa_bench.common.timing import RequestTiming


@dataclass(frozen=True)
class Endpoint:
    """Where a server listens and what its requests must carry to behave alike.

    extra_body: engine-specific fields that make the engine produce exactly max_tokens tokens
    greedily (e.g. {"ignore_eos": true}); the benchmark checks the counts afterwards.
    """

    base_url: str  # e.g. http://127.0.0.1:8001/v1
    model: str
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamedRequest:
    """What the client saw of one request: event arrival times and the server's usage."""

    submit_s: float
    event_s: list[float] = field(default_factory=list)  # arrival of each event that had text
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""
    # llama-server's `timings` of the last event that had them (its draft counters among them).
    server_timings: dict[str, Any] | None = None

    def timing(self) -> RequestTiming:
        """Per-token timing: an event carrying k tokens counts as k tokens arriving together.

        Servers report tokens only in the final usage; events are spread over them evenly in
        arrival order, which is exact for servers that send one token per event."""
        num_tokens = self.completion_tokens or len(self.event_s)
        if not self.event_s:
            return RequestTiming(self.submit_s)
        token_s = [
            self.event_s[min(idx * len(self.event_s) // num_tokens, len(self.event_s) - 1)]
            for idx in range(num_tokens)
        ]
        return RequestTiming(self.submit_s, token_s)


async def stream_one(
    client: Any, endpoint: Endpoint, prompt: str, max_tokens: int
) -> StreamedRequest:
    """One streamed completion, greedy; raises on any HTTP or protocol error."""
    record = StreamedRequest(submit_s=time.perf_counter())
    stream = await client.completions.create(
        model=endpoint.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=endpoint.extra_body or None,
    )
    async for event in stream:
        now = time.perf_counter()
        if event.choices and event.choices[0].text:
            record.event_s.append(now)
            record.text += event.choices[0].text
        timings = (event.model_extra or {}).get("timings")
        if isinstance(timings, dict):
            record.server_timings = timings
        if event.usage is not None:
            record.prompt_tokens = event.usage.prompt_tokens
            record.completion_tokens = event.usage.completion_tokens
    return record


async def run_wave_async(
    endpoint: Endpoint, prompts: list[str], max_tokens: int, timeout_s: float
) -> list[StreamedRequest]:
    """All prompts at once on one client; returns in prompt order."""
    from openai import AsyncOpenAI

    # The client's default pool holds far more connections than any wave opens.
    async with AsyncOpenAI(
        base_url=endpoint.base_url,
        api_key="unused",
        timeout=timeout_s,
        max_retries=0,  # a failed request must fail the wave, not be retried behind its back
    ) as client:
        tasks = [stream_one(client, endpoint, prompt, max_tokens) for prompt in prompts]
        return list(await asyncio.gather(*tasks))


def run_wave(
    endpoint: Endpoint, prompts: list[str], max_tokens: int, timeout_s: float = 900.0
) -> list[StreamedRequest]:
    return asyncio.run(run_wave_async(endpoint, prompts, max_tokens, timeout_s))
