"""The server process: load the model, serve until SIGINT/SIGTERM, drain, exit. Also a helper that
serves an app on a loopback port from a background thread (tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from densa.engine.args import EngineArgs
from densa.engine.async_engine import AsyncEngine
from densa.engine.llm_engine import LLMEngine
from densa.serve.api_server import DEFAULT_MAX_BODY_BYTES, build_app, start_draining
from densa.serve.auth import load_api_keys
from densa.utils.logging import configure_logging, get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 unparsed
    drain_timeout: float = 30.0  # seconds a signal waits for running requests before aborting them
    request_timeout: float | None = None  # seconds one request may take, then it is aborted (504)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: no key needed
    api_key_file: str | None = None  # more keys, one per line
    log_level: str = "info"


def run_server(
    engine_args: EngineArgs, host: str = "127.0.0.1", port: int = 8000, **server_options: Any
) -> None:
    """Load the model, serve until SIGINT/SIGTERM, then drain running requests and return."""
    options = ServerOptions(**server_options)
    configure_logging(options.log_level)
    api_keys = load_api_keys(options.api_keys, options.api_key_file)  # fail before the slow load
    logger.info("loading the model %s", engine_args.model or "(bundled SmolLM2-135M)")
    started = time.monotonic()
    engine = LLMEngine.from_args(engine_args)
    name = engine.config.model.served_model_name
    logger.info("model %r loaded in %.1f s", name, time.monotonic() - started)
    if api_keys.is_enabled:
        logger.info("API keys required on /v1/*")
    async_engine = AsyncEngine(engine)
    async_engine.start()
    app = build_app(
        async_engine,
        name,
        max_body_bytes=options.max_body_bytes,
        request_timeout=options.request_timeout,
        api_keys=api_keys,
    )
    asyncio.run(_serve(app, async_engine, host, port, options))
    logger.info("server stopped")


async def _serve(
    app: FastAPI, engine: AsyncEngine, host: str, port: int, options: ServerOptions
) -> None:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=options.log_level,
        timeout_graceful_shutdown=math.ceil(options.drain_timeout),
    )

    def on_signal() -> None:
        logger.info(
            "shutting down: refusing new requests, draining %d (up to %.0f s)",
            engine.num_in_flight, options.drain_timeout,
        )  # fmt: skip
        start_draining(app)

    try:
        await _DrainingServer(config, on_signal).serve()
    finally:
        await engine.shutdown(options.drain_timeout)


class _DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown (stop listening, wait for open requests), plus two changes:
    the app refuses new requests from the first signal on, and the process exits normally after
    draining instead of re-raising the signal as uvicorn does."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, log_level: str = "warning") -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port from a thread; yield the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # binding here, not in uvicorn, avoids a port race
    port = sock.getsockname()[1]
    # A deep backlog: load tests open dozens of connections at the same instant.
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", backlog=512)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
