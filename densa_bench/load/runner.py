"""`densa bench load`: many concurrent streaming clients that misbehave, and a strict account after.

N clients start at once on loopback, each streaming one /v1/completions request (token-id
prompts, so both sides count prompt tokens exactly), with mixed prompt lengths, half of them
sharing a prefix. Some read every event; some disconnect after a few events; some are cancelled
mid-stream. When all are done (within a time limit), the run checks that nothing was lost:

- every client got either a complete answer ([DONE], a finish reason, usage) or an explicit error
  (an HTTP error with an OpenAI error body; a 429 also carries Retry-After);
- /metrics agrees with the clients: requests by outcome, prompt tokens of admitted requests, output
  and cached tokens within what the clients can know, latency histogram counts;
- afterwards no request is running or waiting, and every KV page is free again.

The same run backs a pytest test (tests/serve/test_load.py) and the benchmark command
(report.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from densa.serve.scrape import MetricSamples, scrape
from densa_bench.load.settings import LoadSettings

CLIENT_CLOSED = "client_closed"  # the server's outcome for a request whose client went away
FIRST_PROMPT_TOKEN_ID = 256  # below: special and byte tokens in common BPE vocabularies
# Valid in every vocabulary densa serves so far (SmolLM2: 49152); prompts are random ids below it.
MAX_PROMPT_TOKEN_ID = 30_000
BEHAVIOURS = ("complete", "disconnect", "cancel")


@dataclass(frozen=True)
class ClientPlan:
    """What one client sends and how it behaves."""

    client_idx: int
    behaviour: str  # one of BEHAVIOURS
    prompt: list[int]
    max_tokens: int
    leave_after_events: int  # disconnect: events read before closing
    cancel_after_s: float  # cancel: seconds after the first event


@dataclass
class ClientResult:
    """What one client saw. `outcome` uses the server's vocabulary, so the two can be compared."""

    plan: ClientPlan
    status: int | None = None
    outcome: str = "hung"  # finish reason | error code | client_closed | a client-side failure
    error_code: str | None = None  # from an error response or an error event
    finish_reason: str | None = None
    has_usage: bool = False
    has_done: bool = False  # saw `data: [DONE]`
    left_early: bool = False  # disconnected or cancelled on purpose
    num_events: int = 0  # events that carried a choice
    completion_tokens: int = 0  # from usage (complete answers only)
    cached_tokens: int = 0
    retry_after: str | None = None
    submit_s: float = 0.0
    first_event_s: float | None = None
    end_s: float | None = None

    @property
    def is_admitted(self) -> bool:
        return self.status == 200

    @property
    def is_complete(self) -> bool:
        return self.outcome in ("stop", "length")

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_event_s is None else self.first_event_s - self.submit_s

    def conclude(self) -> None:
        """Name the outcome once the client is done (finished, errored, left or cancelled)."""
        if self.error_code is not None:
            self.outcome = self.error_code
        elif self.has_done and self.finish_reason and self.has_usage:
            self.outcome = self.finish_reason
        elif self.left_early:
            self.outcome = CLIENT_CLOSED
        else:
            self.outcome = "incomplete_stream"  # the stream ended without [DONE]: lost


def plan_clients(settings: LoadSettings) -> list[ClientPlan]:
    rng = random.Random(settings.seed)
    shared = _random_ids(rng, settings.shared_prefix_len)
    num_disconnect = round(settings.num_clients * settings.disconnect_fraction)
    num_cancel = round(settings.num_clients * settings.cancel_fraction)
    behaviours = ["disconnect"] * num_disconnect + ["cancel"] * num_cancel
    behaviours += ["complete"] * (settings.num_clients - len(behaviours))
    rng.shuffle(behaviours)
    plans = []
    for idx, behaviour in enumerate(behaviours):
        prompt_len = rng.choice(settings.prompt_lens)
        prefix = shared if idx % 2 == 0 else []
        prompt = prefix + _random_ids(rng, prompt_len - len(prefix))
        leaves = behaviour != "complete"
        plans.append(
            ClientPlan(
                client_idx=idx,
                behaviour=behaviour,
                prompt=prompt,
                max_tokens=settings.long_max_tokens if leaves else settings.max_tokens,
                leave_after_events=rng.randint(1, 3),
                cancel_after_s=rng.uniform(0.0, 0.05),
            )
        )
    return plans


def _random_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_PROMPT_TOKEN_ID, MAX_PROMPT_TOKEN_ID) for _ in range(count)]


# ---- one client ---------------------------------------------------------------------------------
async def run_client(
    http: httpx.AsyncClient, base_url: str, model: str, plan: ClientPlan
) -> ClientResult:
    result = ClientResult(plan)
    started = asyncio.Event()
    task = asyncio.create_task(_stream(http, base_url, model, plan, result, started))
    if plan.behaviour == "cancel":
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        await asyncio.sleep(plan.cancel_after_s)
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise  # this coroutine itself was cancelled (the run's time limit)
        result.left_early = True
    except httpx.HTTPError as exc:
        result.error_code = f"transport_error: {type(exc).__name__}"
    result.end_s = time.perf_counter()
    result.conclude()
    return result


async def _stream(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    plan: ClientPlan,
    result: ClientResult,
    started: asyncio.Event,
) -> None:
    body = {
        "model": model,
        "prompt": plan.prompt,
        "max_tokens": plan.max_tokens,
        "ignore_eos": plan.behaviour != "complete",
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.submit_s = time.perf_counter()
    async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            await _read_error(response, result)
            return
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                _take_event(line.removeprefix("data: "), result)
                started.set()
            if result.has_done or result.error_code is not None:
                return
            if plan.behaviour == "disconnect" and result.num_events >= plan.leave_after_events:
                result.left_early = True
                return  # leaving the `async with` closes the connection mid-stream


async def _read_error(response: httpx.Response, result: ClientResult) -> None:
    await response.aread()
    result.retry_after = response.headers.get("retry-after")
    try:
        result.error_code = str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        result.error_code = f"http_{response.status_code}_without_error_body"


def _take_event(data: str, result: ClientResult) -> None:
    if data == "[DONE]":
        result.has_done = True
        return
    event = json.loads(data)
    if "error" in event:
        result.error_code = str(event["error"].get("code"))
        return
    if event.get("usage"):
        result.has_usage = True
        result.completion_tokens = event["usage"]["completion_tokens"]
        details = event["usage"].get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0
    if event.get("choices"):
        result.num_events += 1
        result.first_event_s = result.first_event_s or time.perf_counter()
        result.finish_reason = event["choices"][0].get("finish_reason") or result.finish_reason


# ---- the run ------------------------------------------------------------------------------------
@dataclass
class LoadRun:
    settings: LoadSettings
    results: list[ClientResult]
    before: MetricSamples  # /metrics just before the clients started
    after: MetricSamples  # ... once the server had settled
    wall_s: float

    def delta(self, name: str, **labels: str) -> float:
        return self.after.value(name, **labels) - self.before.value(name, **labels)

    def server_counts(self, label: str) -> Counter[str]:
        before = self.before.by_label("densa_requests_total", label)
        after = self.after.by_label("densa_requests_total", label)
        counts = Counter({key: round(value - before.get(key, 0)) for key, value in after.items()})
        return +counts  # drop zeros


def run_load(base_url: str, model: str, settings: LoadSettings) -> LoadRun:
    """Run every client against a server already listening at base_url; return what happened."""
    plans = plan_clients(settings)
    before = scrape(base_url)
    start_s = time.perf_counter()
    results = asyncio.run(_run_clients(base_url, model, plans, settings.time_limit_s))
    wall_s = time.perf_counter() - start_s
    after = _settled(base_url, before, len(plans))
    return LoadRun(settings, results, before, after, wall_s)


async def _run_clients(
    base_url: str, model: str, plans: list[ClientPlan], time_limit_s: float
) -> list[ClientResult]:
    limits = httpx.Limits(max_connections=len(plans) + 8)
    timeout = httpx.Timeout(time_limit_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        tasks = [asyncio.create_task(run_client(http, base_url, model, plan)) for plan in plans]
        _, pending = await asyncio.wait(tasks, timeout=time_limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    # A client still open at the time limit keeps the outcome "hung": that is a failure.
    return [
        task.result() if task.done() and not task.cancelled() else ClientResult(plan)
        for task, plan in zip(tasks, plans, strict=True)
    ]


def _settled(base_url: str, before: MetricSamples, num_requests: int) -> MetricSamples:
    """/metrics once every request is counted and the engine is idle (or after 30 s)."""
    deadline = time.monotonic() + 30.0
    while True:
        after = scrape(base_url)
        counted = after.value("densa_requests_total") - before.value("densa_requests_total")
        busy = after.value("densa_requests_running") + after.value("densa_requests_waiting")
        if (counted >= num_requests and not busy) or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


# ---- the account --------------------------------------------------------------------------------
def find_problems(run: LoadRun) -> list[str]:
    """Everything that was lost, hung, leaked or miscounted; empty when the run held."""
    return [
        *_client_problems(run.results),
        *_agreement_problems(run),
        *_abandoned_work_problems(run),
        *_leak_problems(run.after),
    ]


def _abandoned_work_problems(run: LoadRun) -> list[str]:
    """Requests whose clients left must stop: the tokens sampled but never handed to a client
    are bounded by a few steps' worth per client that left."""
    num_left = sum(1 for r in run.results if r.outcome == CLIENT_CLOSED)
    wasted = run.delta("densa_engine_generated_tokens_total") - run.delta(
        "densa_generation_tokens_total"
    )
    bound = num_left * run.settings.max_tokens_after_leaving
    if wasted > bound:
        return [
            f"{wasted:.0f} tokens were sampled for nobody ({num_left} clients left; at most "
            f"{bound} expected): abandoned requests kept generating"
        ]
    return []


def _client_problems(results: list[ClientResult]) -> list[str]:
    problems = []
    for r in results:
        who = f"client {r.plan.client_idx} ({r.plan.behaviour})"
        if r.is_complete:
            continue
        if r.outcome == CLIENT_CLOSED and r.plan.behaviour != "complete":
            continue
        if r.status is not None and r.status >= 400 and r.error_code is not None:
            if r.status == 429 and r.retry_after is None:
                problems.append(f"{who}: 429 without Retry-After")
            if r.status >= 500:
                problems.append(f"{who}: server error {r.status} {r.error_code}")
            continue
        problems.append(f"{who}: no complete answer and no explicit error ({r.outcome})")
    return problems


def _agreement_problems(run: LoadRun) -> list[str]:
    results = run.results
    problems = []
    client_outcomes = Counter(r.outcome for r in results)
    if run.server_counts("outcome") != client_outcomes:
        problems.append(
            f"requests by outcome: server {dict(run.server_counts('outcome'))} "
            f"!= clients {dict(client_outcomes)}"
        )
    client_statuses = Counter(str(r.status) for r in results)
    if run.server_counts("status") != client_statuses:
        problems.append(
            f"requests by status: server {dict(run.server_counts('status'))} "
            f"!= clients {dict(client_statuses)}"
        )
    admitted = [r for r in results if r.is_admitted]
    _expect_equal(
        problems,
        "prompt tokens of admitted requests",
        run.delta("densa_prompt_tokens_total"),
        sum(len(r.plan.prompt) for r in admitted),
    )
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        name = f"densa_{histogram}_seconds_count"
        _expect_equal(problems, f"{name} (admitted requests)", run.delta(name), len(admitted))
    complete = [r for r in results if r.is_complete]
    generated = run.delta("densa_generation_tokens_total")
    low = sum(r.completion_tokens for r in complete) + sum(
        r.num_events for r in admitted if not r.is_complete
    )
    high = low + sum(r.plan.max_tokens for r in admitted if not r.is_complete)
    if not low <= generated <= high:
        problems.append(f"output tokens: server counted {generated:g}, clients say {low}..{high}")
    cached = run.delta("densa_cached_prompt_tokens_total")
    if cached < sum(r.cached_tokens for r in complete):
        problems.append(f"cached tokens: server {cached:g} < what complete answers reported")
    return problems


def _expect_equal(problems: list[str], what: str, server: float, clients: int) -> None:
    if round(server) != clients:
        problems.append(f"{what}: server counted {server:g}, clients {clients}")


def _leak_problems(after: MetricSamples) -> list[str]:
    problems = []
    busy = after.value("densa_requests_running") + after.value("densa_requests_waiting")
    if busy:
        problems.append(f"{busy:g} requests still running or waiting after the run")
    free, total = after.value("densa_kv_pages_free"), after.value("densa_kv_pages_total")
    if free != total:
        problems.append(f"KV pages leaked: {free:g} of {total:g} free after the run")
    return problems
