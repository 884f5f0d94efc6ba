"""Server fixtures, each a real uvicorn server over its own tiny-model engine.

`server` is the plain one most tests share. `limited_server` admits one request at a time, takes
bodies up to 64 KiB and runs a `ScriptedEngine`, so tests can overload it, fail requests the way
an integrity violation would, and see what the HTTP layer passed to the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from densa.engine.async_engine import AsyncEngine
from densa.serve.auth import ApiKeys

from .support import (
    RunningServer,
    ScriptedEngine,
    SlowDown,
    make_engine,
    running_server,
    slow_down_steps,
)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(AsyncEngine(make_engine(tiny_model_dir))) as running:
        yield running


@pytest.fixture(scope="session")
def limited_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    with running_server(ScriptedEngine(engine), max_body_bytes=64 * 1024) as running:
        yield running


@pytest.fixture
def scripted(limited_server: RunningServer) -> Iterator[ScriptedEngine]:
    """The limited server's engine, reset after each test (the server is shared)."""
    engine = limited_server.async_engine
    assert isinstance(engine, ScriptedEngine)
    engine.calls.clear()
    yield engine
    engine.fail_after, engine.refuse_with = None, None
    limited_server.app.state.densa.is_draining = False
    limited_server.wait_idle()


@pytest.fixture
def slow_steps(monkeypatch: pytest.MonkeyPatch) -> SlowDown:
    """Call with a server to slow its engine down for this test only."""
    return lambda server: slow_down_steps(server, monkeypatch)


@pytest.fixture
def api_keys(server: RunningServer) -> Iterator[Callable[..., None]]:
    """Call with keys to make the shared server require them, for this test only."""
    state = server.app.state.densa

    def require(*keys: str) -> None:
        state.api_keys = ApiKeys(keys)

    yield require
    state.api_keys = ApiKeys()
