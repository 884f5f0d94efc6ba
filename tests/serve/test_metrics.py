"""GET /metrics (Prometheus) and the one-line-per-request log, checked against what clients saw."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from densa.engine.metrics import EngineStats
from densa.serve.metrics import ServerMetrics
from densa.serve.scrape import MetricSamples, scrape
from densa.serve.tracking import RequestRecord

from .support import MODEL_NAME, RunningServer

CHAT = "/v1/chat/completions"
MESSAGES: list[Any] = [{"role": "user", "content": "Count the waves."}]


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def request_log() -> Iterator[Captured]:
    """The `densa.requests` log lines of this test (a handler of its own: the CLI may have turned
    propagation to the root logger off)."""
    logger = logging.getLogger("densa.requests")
    handler, level = Captured(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def delta(before: MetricSamples, after: MetricSamples, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_metrics_count_requests_tokens_and_latencies(server: RunningServer) -> None:
    client = server.client()
    before = scrape(server.base_url)
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="The sea",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    server.wait_idle()
    after = scrape(server.base_url)

    assert answer.usage is not None and chunks[-1].usage is not None
    usages = [answer.usage, chunks[-1].usage]
    ok = {"status": "200", "outcome": "length"}
    assert delta(before, after, "densa_requests_total", endpoint=CHAT, **ok) == 1
    assert delta(before, after, "densa_requests_total", endpoint="/v1/completions", **ok) == 1
    assert delta(before, after, "densa_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(before, after, "densa_generation_tokens_total") == 9
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert delta(before, after, f"densa_{histogram}_seconds_count") == 2
    assert delta(before, after, "densa_time_to_first_token_seconds_sum") > 0
    assert after.value("densa_kv_pages_free") == after.value("densa_kv_pages_total") > 0
    assert after.value("densa_kv_pages_used") == 0
    assert after.value("densa_requests_running") == after.value("densa_requests_waiting") == 0
    assert after.value("densa_kv_page_size_tokens") == 16
    assert delta(before, after, "densa_engine_steps_total") >= 9
    assert after.by_label("densa_kv_integrity_violations_total", "kind") == {
        "bad_mapping": 0,
        "double_free": 0,
        "stale_read": 0,
        "stale_write": 0,
    }


def test_prefix_cache_and_error_metrics(server: RunningServer) -> None:
    prompt = list(range(300, 300 + 40))  # two full pages to reuse
    before = scrape(server.base_url)
    for _ in range(2):
        server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    bad = httpx.post(server.base_url + CHAT, json={"model": MODEL_NAME, "messages": []})
    assert bad.status_code == 400
    server.wait_idle()  # every response counted
    after = scrape(server.base_url)
    assert delta(before, after, "densa_cached_prompt_tokens_total") == 32
    assert delta(before, after, "densa_prefix_cache_hit_tokens_total") == 32
    assert delta(before, after, "densa_prefix_cache_queried_tokens_total") == 80
    assert 0 < after.value("densa_prefix_cache_hit_rate") <= 1
    assert after.value("densa_kv_pages_cached") >= 2
    refused = {"endpoint": CHAT, "status": "400", "outcome": "invalid_value"}
    assert delta(before, after, "densa_requests_total", **refused) == 1
    assert delta(before, after, "densa_e2e_request_latency_seconds_count") == 2  # not the 400


def test_one_log_line_per_request_with_its_id_and_session(
    server: RunningServer, request_log: Captured
) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}
    headers = {"x-session-affinity": "conv 42"}
    response = httpx.post(server.base_url + CHAT, json=body, headers=headers, timeout=30)
    request_id = response.headers["x-request-id"]
    assert request_id == response.json()["id"]
    assert response.headers["x-session-affinity"] == "conv 42"
    server.wait_idle()
    [line] = [line for line in request_log.lines if request_id in line]
    # logfmt quoting is shell quoting for these values: shlex splits it back.
    fields = dict(
        part.split("=", 1) for part in shlex.split(line.removeprefix("request finished "))
    )
    assert fields["request_id"] == request_id
    assert fields["status"] == "200"
    assert fields["outcome"] == "length"
    assert fields["completion_tokens"] == "3"
    assert fields["session"] == "conv 42"
    assert float(fields["ttft_ms"]) > 0 and float(fields["e2e_ms"]) >= float(fields["ttft_ms"])


def test_session_requests_are_counted(server: RunningServer) -> None:
    before = scrape(server.base_url)
    server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=1, extra_headers={"x-session-affinity": "s"}
    )
    server.wait_idle()
    after = scrape(server.base_url)
    assert delta(before, after, "densa_session_requests_total") == 1


def test_each_app_has_its_own_registry() -> None:
    first, second = ServerMetrics(EngineStats), ServerMetrics(EngineStats)
    record = RequestRecord("cmpl-1", "/v1/completions", status=200, finish_reason="stop")
    first.observe(record)
    assert MetricSamples(first.render().decode()).value("densa_requests_total") == 1
    assert MetricSamples(second.render().decode()).value("densa_requests_total") == 0


def test_kv_tier_counters_are_exported_per_tier() -> None:
    stats = EngineStats(kv_tiers={
        "disk:/kv": {"hits": 6, "misses": 2, "rejected": 1, "fetch_seconds": 0.5, "fetches": 8},
        "shared:redis://s:6379/0": {"hits": 3, "bytes_written": 4096},
    })  # fmt: skip
    samples = MetricSamples(ServerMetrics(lambda: stats).render().decode())
    assert samples.value("densa_kv_tier", tier="disk:/kv", counter="hits") == 6
    assert samples.value("densa_kv_tier", tier="disk:/kv", counter="rejected") == 1
    assert (
        samples.value("densa_kv_tier", tier="shared:redis://s:6379/0", counter="bytes_written")
        == 4096
    )
