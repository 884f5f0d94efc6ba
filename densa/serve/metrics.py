"""`GET /metrics`: Prometheus text format, from finished request records and engine snapshots.

Each app gets its own CollectorRegistry, so several servers in one process (tests, benchmarks)
keep separate counts. Two sources feed it:
- request records (tracking.py), counted once each when the response is over: outcomes, tokens
  and latency histograms as the client saw them;
- the engine's latest `EngineStats` snapshot, read at scrape time: queue depth, KV pages,
  preemptions, prefix-cache hits and integrity violations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from densa.ipc.messages import EngineStats
from densa.serve.tracking import RequestRecord

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds. TTFT spans a cached hit on a tiny model (ms) to a long CPU prefill (tens of s).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    """The server's metrics; `observe` a finished request, `render` for a scrape."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "densa_requests",
            "Generation requests by endpoint, HTTP status and outcome (finish reason / error code)",
            ["endpoint", "status", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "densa_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.cached_tokens = Counter(
            "densa_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter(
            "densa_generation_tokens", "Output tokens handed to responses", registry=r
        )
        self.session_requests = Counter(
            "densa_session_requests", "Requests that carried x-session-affinity", registry=r
        )
        self.ttft = Histogram(
            "densa_time_to_first_token_seconds",
            "Arrival to first output token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "densa_time_per_output_token_seconds",
            "Mean gap between output tokens after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "densa_e2e_request_latency_seconds",
            "Arrival to the end of the response, for requests the engine admitted",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine_stats))

    def observe(self, record: RequestRecord) -> None:
        status = str(record.status or 0)
        self.requests.labels(record.endpoint, status, record.outcome).inc()
        if record.session_id is not None:
            self.session_requests.inc()
        if not record.is_admitted:
            return
        self.prompt_tokens.inc(record.num_prompt_tokens)
        self.cached_tokens.inc(record.num_cached_tokens)
        self.generation_tokens.inc(record.num_output_tokens)
        self.e2e.observe(record.e2e_s)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        if record.tpot_s is not None:
            self.tpot.observe(record.tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine gauges and lifetime counters, read from the latest snapshot at scrape time."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        yield from _load_metrics(stats)
        yield from _work_metrics(stats)
        yield from _labelled_metrics(stats)


def _load_metrics(s: EngineStats) -> Iterator[Metric]:
    """What the engine holds now: requests, KV pages, the prefix cache."""
    yield _gauge("densa_requests_running", "Requests being computed", s.num_running)
    yield _gauge("densa_requests_waiting", "Requests queued or preempted", s.num_waiting)
    yield _gauge(
        "densa_session_requests_in_flight",
        "Running and waiting requests with x-session-affinity",
        s.num_session_requests,
    )
    yield _gauge("densa_kv_pages_total", "KV pages in the pool", s.num_kv_pages)
    yield _gauge("densa_kv_pages_free", "KV pages no request holds", s.num_free_kv_pages)
    yield _gauge("densa_kv_pages_used", "KV pages held by requests", s.num_used_kv_pages)
    yield _gauge(
        "densa_kv_pages_cached", "KV pages indexed by the prefix cache", s.num_cached_kv_pages
    )
    yield _gauge("densa_kv_page_size_tokens", "Tokens per KV page", s.page_size)
    yield _gauge(
        "densa_kv_resident_tokens",
        "Tokens whose K/V running requests hold (a shared prefix counts once per request)",
        s.num_resident_tokens,
    )
    yield _gauge(
        "densa_prefix_cache_hit_rate",
        "Share of looked-up prompt tokens found in the prefix cache, since start",
        s.prefix_hit_rate,
    )
    yield _counter(
        "densa_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        s.num_prefix_queried_tokens,
    )
    yield _counter(
        "densa_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache",
        s.num_prefix_hit_tokens,
    )


def _work_metrics(s: EngineStats) -> Iterator[Metric]:
    """What the engine has done since start: steps, tokens, preemptions, speculation."""
    yield _counter("densa_preemptions", "Requests preempted for KV pages", s.num_preemptions)
    yield _counter("densa_engine_steps", "Engine steps run", s.num_steps)
    yield _counter(
        "densa_engine_generated_tokens",
        "Tokens the engine sampled, including any whose client had gone (compare with "
        "densa_generation_tokens: the difference is work done for nobody)",
        s.num_generated_tokens,
    )
    yield _counter(
        "densa_spec_proposed_tokens",
        "Speculative tokens proposed to the target model for verification",
        s.num_spec_proposed_tokens,
    )
    yield _counter(
        "densa_spec_accepted_tokens",
        "Speculative tokens the target accepted (acceptance rate: accepted / proposed)",
        s.num_spec_accepted_tokens,
    )
    yield _counter(
        "densa_spec_paused_steps",
        "Steps on which speculation paused: more requests decoded than --speculative-max-batch",
        s.num_spec_paused_steps,
    )


def _labelled_metrics(s: EngineStats) -> Iterator[Metric]:
    """Families with labels: integrity violations by kind, KV transfers, KV tiers."""
    violations = CounterMetricFamily(
        "densa_kv_integrity_violations", "KV page tag mismatches by kind", labels=["kind"]
    )
    for kind, count in sorted(s.integrity_violations.items()):
        violations.add_metric([kind], count)
    yield violations
    if s.disagg:  # a prefill or decode worker (docs/disaggregation.md)
        kv = GaugeMetricFamily(
            "densa_kv_transfer",
            "KV handoff counters (totals) and gauges (transfers per state, held pages)",
            labels=["name"],
        )
        for name, value in sorted(s.disagg.items()):
            kv.add_metric([name], value)
        yield kv
    if s.kv_tiers:  # --kv-tier (docs/kv-cache.md)
        tiers = GaugeMetricFamily(
            "densa_kv_tier",
            "KV tier counters since start: hits, misses, rejected (failed a check), bytes "
            "read and written, blocks written, write errors, fetch seconds and fetches "
            "(mean fetch latency = fetch_seconds / fetches), disabled (1 when off)",
            labels=["tier", "counter"],
        )
        for tier, counters in sorted(s.kv_tiers.items()):
            for name, value in sorted(counters.items()):
                tiers.add_metric([tier, name], value)
        yield tiers


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
