"""The router's `GET /metrics` (Prometheus text format, its own registry).

densa_router_decisions_total{signal}          placements by the signal that decided them
densa_router_requests_total{worker,status}    responses by worker and HTTP status
densa_router_retries_total{reason}            attempts moved to another worker (no byte sent)
densa_router_ejections_total{worker,reason}   workers taken out of rotation

Label values are the router's own: worker URLs from its flags or an admin's PUT, a status code
it checked is one, and reasons from the fixed FAILURE_REASONS (anything else counts as "other").
densa_router_no_worker_total                  requests answered 503: no worker could take them
densa_router_decision_seconds                 read + tokenize + score, per request
densa_router_worker_*{worker}                 per-worker load as the router sees it (scrape time)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from densa.router.workers import FAILURE_REASONS, Worker

CONTENT_TYPE = CONTENT_TYPE_LATEST
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class RouterMetrics:
    def __init__(self, workers: Callable[[], list[Worker]]) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter(
            "densa_router_decisions", "Placements by the signal that decided them", ["signal"],
            registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "densa_router_requests", "Responses by worker and HTTP status", ["worker", "status"],
            registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "densa_router_retries", "Attempts moved to another worker before any byte was sent",
            ["reason"], registry=r,
        )  # fmt: skip
        self.ejections = Counter(
            "densa_router_ejections", "Workers taken out of rotation", ["worker", "reason"],
            registry=r,
        )  # fmt: skip
        self.no_worker = Counter(
            "densa_router_no_worker", "Requests answered 503 because no worker could take them",
            registry=r,
        )  # fmt: skip
        self.decision_seconds = Histogram(
            "densa_router_decision_seconds", "Reading, tokenizing and scoring one request",
            buckets=_DECISION_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_WorkerCollector(workers))

    def count_response(self, worker: str, status: int) -> None:
        self.requests.labels(worker, str(status) if 100 <= status <= 599 else "other").inc()

    def count_retry(self, reason: str) -> None:
        self.retries.labels(reason_label(reason)).inc()

    def count_ejection(self, worker: str, reason: str) -> None:
        self.ejections.labels(worker, reason_label(reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def reason_label(reason: str) -> str:
    """`reason` if it is one of the fixed FAILURE_REASONS, else "other"."""
    return reason if reason in FAILURE_REASONS else "other"


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], list[Worker]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "healthy": ("1 if the worker is in rotation", lambda w: float(w.is_healthy)),
            "queue_depth": ("Requests running or waiting on the worker", lambda w: w.queue_depth),
            "open_requests": ("Requests this router has open on the worker", lambda w: w.num_open),
            "free_kv_pages": (
                "Free KV pages the worker last reported",
                lambda w: w.load.num_free_kv_pages if w.load else 0,
            ),
            "pending_output_tokens": (
                "Expected output tokens of the router's open requests there",
                lambda w: w.pending_output_tokens,
            ),
            "indexed_blocks": ("Prompt blocks in the router's index", lambda w: len(w.prefix)),
        }
        workers = self._workers()
        for name, (documentation, value) in gauges.items():
            family = GaugeMetricFamily(
                f"densa_router_worker_{name}", documentation, labels=["worker"]
            )
            for worker in workers:
                family.add_metric([worker.url], float(value(worker)))
            yield family
