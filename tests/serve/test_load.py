"""64 concurrent streaming clients, some leaving early, some cancelled, against a server that admits
fewer: nothing is lost, nothing leaks, and /metrics agrees with what the clients saw.

And requests whose clients left (streaming or not) stop: the engine aborts them within a few steps,
rather than generating every token they asked for, for nobody.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from densa.serve.scrape import scrape
from densa_bench.load.runner import CLIENT_CLOSED, find_problems, run_load
from densa_bench.load.settings import LoadSettings

from .support import MAX_MODEL_LEN, MODEL_NAME, RunningServer, engine_client, running_server

SETTINGS = LoadSettings(
    num_clients=64,
    prompt_lens=(40, 80, 150, 300),
    shared_prefix_len=32,
    max_tokens=12,
    long_max_tokens=180,
    time_limit_s=60,
)


@pytest.fixture(scope="module")
def busy_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """16 running + 24 waiting requests at most (then 429), and too few KV pages for all of them
    at full length, so preemption happens too."""
    engine = engine_client(
        tiny_model_dir, max_num_seqs=16, num_kv_pages=48, max_waiting_requests=24
    )
    with running_server(engine) as running:
        yield running


def test_64_streaming_clients_nothing_lost(busy_server: RunningServer) -> None:
    run = run_load(busy_server.base_url, MODEL_NAME, SETTINGS)
    assert find_problems(run) == []
    outcomes = [r.outcome for r in run.results]
    assert outcomes.count(CLIENT_CLOSED) >= 10  # the ones that left early or were cancelled
    assert outcomes.count("rate_limit_exceeded") > 0  # more clients than the server admits
    assert sum(r.is_complete for r in run.results) > 10
    assert run.delta("densa_cached_prompt_tokens_total") > 0  # the shared prefix was reused
    busy_server.wait_idle()
    assert run.wall_s < SETTINGS.time_limit_s


# ---- abandoned requests stop --------------------------------------------------------------------
LEAVER_MAX_TOKENS = MAX_MODEL_LEN - 32  # ignore_eos: each would run this many steps if left alone
LEAVER_STEP_DELAY_S = 0.025  # so LEAVER_MAX_TOKENS takes >= 12 s, and 1 s >= 40 steps, at most
PLAIN_WAIT_S = 1.0  # a non-streaming client gives up (closes its connection) after this
NUM_LEAVERS = 4  # of each kind
# A request whose client left may still be stepped while the server notices and the abort crosses
# from the event loop to the engine (40 steps take >= 1 s at this step delay: room for a loaded
# machine); more steps than this, or more tokens per request, means it kept running.
MAX_TOKENS_AFTER_LEAVING = 40


def _leave_a_stream(base_url: str, idx: int) -> int:
    """Stream a long answer, leave after two events; the events read."""
    body = _leaver_body(idx, stream=True)
    events = 0
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            events += line.startswith("data: {")
            if events == 2:
                break  # leaving the `with` closes the connection mid-stream
    return events


def _leave_a_plain_request(base_url: str, idx: int) -> int:
    """Ask for a long answer without streaming, give up waiting for it; 0 (no events)."""
    timeout = httpx.Timeout(60, read=PLAIN_WAIT_S)
    body = _leaver_body(idx, stream=False)
    with pytest.raises(httpx.ReadTimeout):  # closes the connection: nobody waits for the answer
        httpx.post(base_url + "/v1/completions", json=body, timeout=timeout)
    return 0


def _leaver_body(idx: int, stream: bool) -> dict[str, Any]:
    prompt = [700 + idx, 800 + idx, 900 + idx, 1000 + idx]
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": LEAVER_MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": stream}  # fmt: skip


def test_abandoned_requests_stop(busy_server: RunningServer) -> None:
    """Clients that leave mid-answer (some mid-stream, some waiting for a whole answer): their
    requests leave the engine within a few steps, all their pages are freed, the engine samples
    far fewer tokens than they asked for, and /metrics counts each as client_closed."""
    server = busy_server
    server.wait_idle(timeout=30)
    metrics_before, stats_before = scrape(server.base_url), server.stats
    server.set_step_delay(LEAVER_STEP_DELAY_S)
    try:
        with concurrent.futures.ThreadPoolExecutor(2 * NUM_LEAVERS) as pool:
            streams = [pool.submit(_leave_a_stream, server.base_url, i) for i in range(NUM_LEAVERS)]
            plain = [pool.submit(_leave_a_plain_request, server.base_url, NUM_LEAVERS + i)
                     for i in range(NUM_LEAVERS)]  # fmt: skip
            events = [future.result() for future in streams + plain]
        assert events == [2] * NUM_LEAVERS + [0] * NUM_LEAVERS
        stats_left = server.stats  # every client has gone: from here on, nobody is listening
        # Left alone they would run >= 12 s more; aborted, they are gone within a few steps.
        server.wait_idle(timeout=30)  # nothing running or waiting, every KV page free
        stats_idle = server.stats
    finally:
        server.set_step_delay(0.0)
    num_leavers = 2 * NUM_LEAVERS
    after_leaving = stats_idle.num_generated_tokens - stats_left.num_generated_tokens
    assert after_leaving <= num_leavers * MAX_TOKENS_AFTER_LEAVING, (
        f"{after_leaving} tokens were sampled after all {num_leavers} clients had left: "
        "abandoned requests kept generating"
    )
    steps_after_leaving = stats_idle.num_steps - stats_left.num_steps
    assert steps_after_leaving <= MAX_TOKENS_AFTER_LEAVING, steps_after_leaving
    generated = stats_idle.num_generated_tokens - stats_before.num_generated_tokens
    assert generated < num_leavers * LEAVER_MAX_TOKENS // 4, generated
    assert stats_idle.num_free_kv_pages == stats_idle.num_kv_pages
    metrics = scrape(server.base_url)
    for status, count in (("200", NUM_LEAVERS), ("499", NUM_LEAVERS)):  # streamed, or not yet
        closed = {"status": status, "outcome": CLIENT_CLOSED}
        delta = metrics.value("densa_requests_total", **closed) - metrics_before.value(
            "densa_requests_total", **closed
        )
        assert delta == count, (status, delta)
    assert metrics.value("densa_requests_running") + metrics.value("densa_requests_waiting") == 0
    assert metrics.value("densa_kv_pages_free") == metrics.value("densa_kv_pages_total")
