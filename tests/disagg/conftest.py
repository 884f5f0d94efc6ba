"""Servers for the disaggregation tests: a co-located reference (role both), and one prefill and
one decode worker, each a real uvicorn front over its own engine core process (tiny model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve.support import RunningServer, engine_client, running_server

TIMEOUT_S = 3.0  # every transfer state's deadline in these tests (short: faults resolve fast)


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(engine_client(tiny_model_dir)) as running:
        yield running


@pytest.fixture(scope="session")
def prefill(tiny_model_dir: Path) -> Iterator[RunningServer]:
    client = engine_client(tiny_model_dir, role="prefill", kv_transfer_timeout=TIMEOUT_S)
    with running_server(client) as running:
        yield running


@pytest.fixture(scope="session")
def decode(tiny_model_dir: Path) -> Iterator[RunningServer]:
    client = engine_client(tiny_model_dir, role="decode", kv_transfer_timeout=TIMEOUT_S)
    with running_server(client) as running:
        yield running
