"""Server fixtures, each a real uvicorn server over its own engine core process (tiny model).

`server` is the plain one most tests share. `limited_server` admits one request at a time, takes
bodies up to 64 KiB and runs a `ScriptedClient`, so tests can overload it, fail requests the way
an integrity violation would, and see what the HTTP layer passed to the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from densa.serve.auth import ApiKeys
from densa.serve.state import ApiOptions

from .support import RunningServer, ScriptedClient, engine_client, running_server

SlowDown = Callable[[RunningServer], None]


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(engine_client(tiny_model_dir)) as running:
        yield running


@pytest.fixture(scope="session")
def limited_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    client = engine_client(tiny_model_dir, ScriptedClient, max_num_seqs=1, max_waiting_requests=0)
    with running_server(client, max_body_bytes=64 * 1024) as running:
        yield running


@pytest.fixture
def scripted(limited_server: RunningServer) -> Iterator[ScriptedClient]:
    """The limited server's engine client, reset after each test (the server is shared)."""
    client = limited_server.engine
    assert isinstance(client, ScriptedClient)
    client.calls.clear()
    yield client
    client.fail_after, client.refuse_with = None, None
    limited_server.app.state.densa.is_draining = False
    limited_server.wait_idle()


@pytest.fixture
def slow_steps() -> Iterator[SlowDown]:
    """Call with a server to make its engine steps 10 ms longer, for this test only."""
    slowed: list[RunningServer] = []

    def slow(server: RunningServer) -> None:
        server.set_step_delay(0.01)
        slowed.append(server)

    yield slow
    for server in slowed:
        server.set_step_delay(0.0)


@pytest.fixture
def api_keys(server: RunningServer) -> Iterator[Callable[..., None]]:
    """Call with keys to make the shared server require them, for this test only."""
    state = server.app.state.densa

    def require(*keys: str) -> None:
        state.api_keys = ApiKeys(keys)

    yield require
    state.api_keys = ApiKeys()


@pytest.fixture
def api_options(server: RunningServer) -> Iterator[Callable[..., None]]:
    """Call with ApiOptions fields (strict_api=True, ...) to set them on the shared server, for
    this test only."""
    state = server.app.state.densa

    def configure(**options: object) -> None:
        state.api = ApiOptions(**options)  # type: ignore[arg-type]

    yield configure
    state.api = ApiOptions()
