"""The server process: load the model, serve until SIGINT/SIGTERM, drain, exit. Also a helper that
serves an app on a loopback port from a background thread (tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from densa.auth.frames import link_secret
from densa.auth.secret import load_secret
from densa.engine.client import ClientOptions, EngineClient
from densa.engine.launch import ProcessLauncher
from densa.openai.http_protocol import DEFAULT_HEADER_TIMEOUT, with_header_timeout
from densa.openai.prepare import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES
from densa.openai.reasoning import reasoning_format
from densa.serve.api_server import build_app, start_draining
from densa.serve.auth import load_api_keys
from densa.serve.disagg import PlacementPolicy, peer_base_url
from densa.serve.state import ApiOptions
from densa.setup.args import EngineArgs
from densa.utils.logging import configure_logging, get_logger
from densa.utils.net import bind_listener, tcp_socket

logger = get_logger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 unparsed
    drain_timeout: float = 30.0  # seconds a signal waits for running requests before aborting them
    request_timeout: float | None = None  # seconds one request may take, then it is aborted (504)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: no key needed
    api_key_file: str | None = None  # more keys, one per line
    tool_call_format: str = "auto"  # openai/tools/formats.py: TOOL_FORMATS, or the template's
    log_level: str = "info"
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds to receive request headers (408)
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds to receive a request body (408)
    engine_placement: str = "process"  # the engine core in its own process, or "thread"
    engine_step_timeout: float = ClientOptions.step_timeout_s  # one step longer: stuck, restart
    engine_restarts: int = ClientOptions.max_restarts  # engines dying young, then exit 1
    # Decode role: prefill workers requests may name without the router's signed placement.
    prefill_peers: tuple[str, ...] = ()
    strict_api: bool = False  # unknown request fields are a 400 (default: dropped, warned about)
    served_model_names: tuple[str, ...] = ()  # every id clients may send ((): the engine's own)
    accept_any_model_name: bool = False  # serve any "model" a request names
    reasoning_parser: str | None = None  # openai/reasoning.py: REASONING_FORMATS
    chat_template: str | None = None  # a Jinja file replacing the model's chat template


def run_server(
    engine_args: EngineArgs, host: str = "127.0.0.1", port: int = 8000, **server_options: Any
) -> None:
    """Load the model, serve until SIGINT/SIGTERM, then drain running requests and return.

    Everything that can be checked without the model is checked first (options, API keys, the
    listening port), so a typo fails in milliseconds, not after a model load.
    """
    options = ServerOptions(**server_options)
    configure_logging(options.log_level)
    engine_args.check()
    api_keys = load_api_keys(options.api_keys, options.api_key_file)
    placement = placement_policy(engine_args, options)
    api = api_options(options)
    sock = bind_listener(host, port)
    try:
        _load_and_serve(engine_args, sock, options, api_keys, placement, api)
    finally:
        sock.close()
    logger.info("server stopped")


class EngineGaveUp(RuntimeError):
    """The engine kept dying and the client stopped restarting it: exit non-zero."""


def placement_policy(engine_args: EngineArgs, options: ServerOptions) -> PlacementPolicy:
    """Who may name a prefill worker: checked before the model loads, so a bad secret file or
    allowlist entry fails in milliseconds."""
    secret = load_secret(engine_args.cluster_secret_file)
    for url in options.prefill_peers:
        try:
            peer_base_url(url)
        except ValueError as exc:
            raise ValueError(f"--prefill-peer {url!r} is not scheme://host:port ({exc})") from exc
    if engine_args.role != "both":
        link_secret(engine_args.role, secret)  # no secret, no KV link (the engine checks again)
    return PlacementPolicy(secret, options.prefill_peers)


def _load_and_serve(
    engine_args: EngineArgs,
    sock: socket.socket,
    options: ServerOptions,
    api_keys: Any,
    placement: PlacementPolicy,
    api: ApiOptions,
) -> None:
    client = make_engine_client(engine_args, options)
    if api_keys.is_enabled:
        logger.info("API keys required on /v1/*")
    app = build_app(
        client,
        max_body_bytes=options.max_body_bytes,
        request_timeout=options.request_timeout,
        api_keys=api_keys,
        body_timeout=options.body_timeout,
        drain_timeout=options.drain_timeout,
        tool_call_format=options.tool_call_format,
        placement=placement,
        api=api,
    )
    asyncio.run(_serve(app, client, sock, options))
    if client.has_failed:
        raise EngineGaveUp(f"the engine failed and was not restarted: {client.failure}")


def api_options(options: ServerOptions) -> ApiOptions:
    """The API's options, checked (an unknown parser, an unreadable template: ValueError)."""
    if options.reasoning_parser is not None:
        reasoning_format(options.reasoning_parser)
    template = None
    if options.chat_template is not None:
        try:
            template = Path(options.chat_template).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {options.chat_template}: {exc}") from exc
    return ApiOptions(
        strict_api=options.strict_api,
        served_model_names=options.served_model_names,
        accept_any_model_name=options.accept_any_model_name,
        reasoning_parser=options.reasoning_parser,
        chat_template=template,
    )


def make_engine_client(engine_args: EngineArgs, options: ServerOptions) -> EngineClient:
    """An engine core in its own process (the default), or on a thread of this one."""
    client_options = ClientOptions(
        step_timeout_s=options.engine_step_timeout, max_restarts=options.engine_restarts
    )
    if options.engine_placement == "thread":
        from densa.engine.inproc import ThreadLauncher  # imports torch: only in this placement
        from densa.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_args(engine_args)  # its config.disagg: role and KV link
        return EngineClient(ThreadLauncher(engine), client_options)
    launcher = ProcessLauncher(dataclasses.asdict(engine_args), log_level=options.log_level)
    return EngineClient(launcher, client_options)


async def _serve(
    app: FastAPI, engine: EngineClient, sock: socket.socket, options: ServerOptions
) -> None:
    started = time.monotonic()
    served = await engine.start()  # before uvicorn: a failed start is one line, not a traceback
    logger.info("engine ready in %.1f s: serving %r", time.monotonic() - started, served.name)
    config = uvicorn.Config(
        app,
        log_level=options.log_level,
        timeout_graceful_shutdown=math.ceil(options.drain_timeout),
        http=with_header_timeout(options.header_timeout),
    )
    state = app.state.densa

    def on_signal() -> None:
        logger.info(
            "shutting down: refusing new requests (503), draining %d (up to %.0f s)",
            engine.num_in_flight, options.drain_timeout,
        )  # fmt: skip
        start_draining(app)

    def is_drained() -> bool:
        return engine.num_in_flight == 0 and state.num_open_responses == 0

    server = _DrainingServer(config, on_signal, is_drained, options.drain_timeout)
    engine.on_failed = lambda: setattr(server, "should_exit", True)
    try:
        await server.serve(sockets=[sock])
    finally:
        await engine.shutdown(options.drain_timeout)  # a no-op if the app's lifespan did it


class _DrainingServer(uvicorn.Server):
    """uvicorn with a drain phase in front of its shutdown.

    The first SIGINT/SIGTERM does not stop listening: the app answers new requests with 503
    (so a load balancer retries them elsewhere instead of seeing refused connections) while the
    running ones finish. Once none is left, or after the drain timeout, uvicorn's own shutdown
    runs (stop listening, close idle connections) and the process exits normally instead of
    re-raising the signal. A second signal skips the drain.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        on_signal: Callable[[], None],
        is_drained: Callable[[], bool],
        drain_timeout: float,
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._is_drained = is_drained
        self._drain_timeout = drain_timeout
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self._drain_timeout
            self._on_signal()
            return
        super().handle_exit(sig, frame)  # a second signal: stop now

    async def on_tick(self, counter: int) -> bool:
        deadline = self._drain_deadline
        if deadline is not None and (self._is_drained() or time.monotonic() > deadline):
            self.should_exit = True
        return await super().on_tick(counter)

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
def serve_in_thread(
    app: FastAPI, log_level: str = "warning", header_timeout: float = DEFAULT_HEADER_TIMEOUT
) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port from a thread; yield the base URL."""
    sock = tcp_socket()
    sock.bind(("127.0.0.1", 0))  # binding here, not in uvicorn, avoids a port race
    port = sock.getsockname()[1]
    # A deep backlog: load tests open dozens of connections at the same instant. The lifespan
    # starts the app's engine on the server's loop (and stops it with the server).
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        backlog=512,
        http=with_header_timeout(header_timeout),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # the engine loads its model first
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


@contextlib.contextmanager
def serve_engine_in_thread(
    engine_args: EngineArgs, engine_placement: str = "process", **app_options: Any
) -> Iterator[tuple[str, EngineClient]]:
    """An engine (its own process by default) behind an app served from a thread: (base URL,
    client). Benchmarks use it to measure the server as `densa serve` runs it. `app_options` go
    to build_app (e.g. `placement`, the decode role's PlacementPolicy)."""
    client = make_engine_client(engine_args, ServerOptions(engine_placement=engine_placement))
    with serve_in_thread(build_app(client, **app_options)) as base_url:
        yield base_url, client
