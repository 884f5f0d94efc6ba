"""64 concurrent streaming clients, some leaving early, some cancelled, against a server that admits
fewer: nothing is lost, nothing leaks, and /metrics agrees with what the clients saw."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from densa.bench.load import CLIENT_CLOSED, LoadSettings, find_problems, run_load

from .support import MODEL_NAME, RunningServer, engine_client, running_server

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
