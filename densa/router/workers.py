"""The workers behind the router: what each one reported, what the router has open on it, and
whether it is in rotation.

Health and load come from one poll (`GET /densa/load`, densa/serve/peer.py) every
`poll_interval_s`, so a load figure is at most about one interval plus one engine heartbeat old.
A worker is *admitted* after its first good answer and *ejected* on a failed poll or a failed
proxy connection. An ejected worker is probed again after an exponentially growing delay
(base, 2 base, 4 base, ... up to `max_backoff_s`) and re-admitted by the first good answer:

    failures:   1      2      3      4      ...
    next probe: 0.5 s  1 s    2 s    4 s    ... 30 s
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from densa.router.prefix import WorkerPrefixIndex
from densa.utils.logging import get_logger

logger = get_logger(__name__)

ROLES = ("mixed", "prefill", "decode")
# Why an attempt moved on or a worker left rotation: fixed words, the only values of the metrics'
# `reason` labels (router/metrics.py). Nothing a worker writes (an error body, an exception's
# message) becomes a reason: a label value is a series of its own, so a worker's text there
# would grow /metrics without bound and write into it.
FAILURE_REASONS = ("connect", "worker_unavailable", "lost_before_answer", "lost_mid_stream",
                   "poll_status", "poll_failed", "other")  # fmt: skip
STORE_ID = re.compile(r"[0-9a-f]{8,32}")  # what a shared KV store id looks like


@dataclass(frozen=True)
class LoadReport:
    num_running: int
    num_waiting: int
    num_in_flight: int
    num_kv_pages: int
    num_free_kv_pages: int
    page_size: int
    engine_pid: int
    received_at: float
    # The worker's shared KV store (an opaque id, densa/cache/tiers/shared.py store_id); None:
    # none, or not a short hex string (a worker's text is only ever compared, never shown).
    shared_kv_tier: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any], received_at: float) -> LoadReport:
        names = ("num_running", "num_waiting", "num_in_flight", "num_kv_pages",
                 "num_free_kv_pages", "page_size", "engine_pid")  # fmt: skip
        store = body.get("shared_kv_tier")
        if not (isinstance(store, str) and STORE_ID.fullmatch(store)):
            store = None
        return cls(**{n: int(body[n]) for n in names}, received_at=received_at,
                   shared_kv_tier=store)  # fmt: skip


@dataclass
class Worker:
    url: str  # exactly as given on the command line: it is what x-densa-worker names
    role: str = "mixed"
    prefix: WorkerPrefixIndex = field(default_factory=lambda: WorkerPrefixIndex(1))
    load: LoadReport | None = None
    is_healthy: bool = False  # in rotation: admitted after its first good poll
    num_failures: int = 0  # consecutive failed polls or connections
    next_probe_at: float = 0.0
    num_open: int = 0  # requests this router has open on the worker
    num_closed_since_poll: int = 0  # ... that finished after the latest load report
    pending_output_tokens: int = 0  # their expected output tokens
    num_routed: int = 0

    @property
    def queue_depth(self) -> int:
        """Requests on the worker: its front's count at the latest poll, less those of ours that
        finished since (a poll can be ~1 s old; without this a worker that just went idle
        would look busy until the next one), but never fewer than ours still open."""
        polled = 0 if self.load is None else self.load.num_in_flight - self.num_closed_since_poll
        return max(polled, self.num_open)

    def endpoint(self, path: str) -> str:
        return self.url.rstrip("/") + path


@dataclass(frozen=True)
class HealthOptions:
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 1.0
    backoff_base_s: float = 0.5
    max_backoff_s: float = 30.0

    def backoff(self, num_failures: int) -> float:
        return min(self.backoff_base_s * 2 ** max(num_failures - 1, 0), self.max_backoff_s)


@dataclass
class WorkerPool:
    """Every worker by URL. `on_ejected(url)` and `on_admitted(url)` let the router drop
    sessions and count ejections; they run on the event loop."""

    workers: dict[str, Worker]
    options: HealthOptions = field(default_factory=HealthOptions)
    on_ejected: Callable[[str, str], None] = lambda url, reason: None
    on_admitted: Callable[[str], None] = lambda url: None
    clock: Callable[[], float] = time.monotonic

    def healthy(self, role: str | None = None) -> list[Worker]:
        return [w for w in self.workers.values() if w.is_healthy and role in (None, w.role)]

    # ---- what polls and proxies report --------------------------------------------------------
    def report_ok(self, worker: Worker, load: LoadReport) -> None:
        if worker.load is not None and worker.load.engine_pid != load.engine_pid:
            worker.prefix.clear()  # a new engine life: its prefix cache started empty
        worker.load = load
        worker.num_closed_since_poll = 0
        worker.prefix.capacity = max(load.num_kv_pages, 1)  # it cannot cache more pages than this
        worker.num_failures = 0
        worker.next_probe_at = self.clock() + self.options.poll_interval_s
        if not worker.is_healthy:
            worker.is_healthy = True
            logger.info("worker %s admitted (%d free KV pages)", worker.url, load.num_free_kv_pages)
            self.on_admitted(worker.url)

    def report_failure(self, worker: Worker, reason: str, detail: str = "") -> None:
        """A poll or a proxy connection failed: eject the worker (if in rotation), back off.
        `reason` is one of FAILURE_REASONS; `detail` (our own words) goes to the log only."""
        if reason not in FAILURE_REASONS:
            detail, reason = f"{reason} {detail}".strip(), "other"
        worker.num_failures += 1
        delay = self.options.backoff(worker.num_failures)
        worker.next_probe_at = self.clock() + delay
        if worker.is_healthy:
            worker.is_healthy = False
            worker.prefix.clear()  # whatever comes back may be a new engine with an empty cache
            logger.warning("worker %s ejected (%s%s); next probe in %.1f s", worker.url, reason,
                           f": {detail!r}" if detail else "", delay)  # fmt: skip
            self.on_ejected(worker.url, reason)

    # ---- polling ------------------------------------------------------------------------------
    async def poll_due(self, client: httpx.AsyncClient) -> None:
        now = self.clock()
        due = [w for w in self.workers.values() if w.next_probe_at <= now]
        await asyncio.gather(*(self._poll(client, w) for w in due))

    async def _poll(self, client: httpx.AsyncClient, worker: Worker) -> None:
        try:
            response = await client.get(
                worker.endpoint("/densa/load"), timeout=self.options.poll_timeout_s
            )
            if response.status_code != 200:
                self.report_failure(worker, "poll_status", f"/densa/load {response.status_code}")
                return
            self.report_ok(worker, LoadReport.from_json(response.json(), self.clock()))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.report_failure(worker, "poll_failed", f"/densa/load {type(exc).__name__}")

    async def run(self, client: httpx.AsyncClient) -> None:
        """Poll forever (until cancelled)."""
        while True:
            await self.poll_due(client)
            await asyncio.sleep(self.options.poll_interval_s / 5)
