"""Servers for the disaggregation tests: a co-located reference (role both), and one prefill and
one decode worker, each a real uvicorn front over its own engine core process (tiny model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from densa.auth.placement import PLACEMENT_HEADER, sign_placement
from densa.auth.secret import ClusterSecret
from densa.serve.disagg import PREFILL_HEADER, PlacementPolicy
from tests.serve.support import RunningServer, engine_client, running_server

TIMEOUT_S = 3.0  # every transfer state's deadline in these tests (short: faults resolve fast)
# The cluster secret the workers share here, as a router would hold it.
SECRET = ClusterSecret(b"densa-tests-cluster-secret-0123456789")


def placed(prefill_url: str) -> dict[str, str]:
    """The headers a router sends a decode worker: the prefill worker and its signed token."""
    return {PREFILL_HEADER: prefill_url, PLACEMENT_HEADER: sign_placement(SECRET, prefill_url)}


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    SECRET.write(path)
    return path


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(engine_client(tiny_model_dir)) as running:
        yield running


@pytest.fixture(scope="session")
def prefill(tiny_model_dir: Path, secret_file: Path) -> Iterator[RunningServer]:
    client = engine_client(
        tiny_model_dir, role="prefill", kv_transfer_timeout=TIMEOUT_S,
        cluster_secret_file=str(secret_file),
    )  # fmt: skip
    with running_server(client) as running:
        yield running


@pytest.fixture(scope="session")
def decode(tiny_model_dir: Path, secret_file: Path) -> Iterator[RunningServer]:
    client = engine_client(
        tiny_model_dir, role="decode", kv_transfer_timeout=TIMEOUT_S,
        cluster_secret_file=str(secret_file),
    )  # fmt: skip
    with running_server(client, placement=PlacementPolicy(SECRET)) as running:
        yield running
