"""Runs an LLMEngine on a background thread and streams its outputs to asyncio callers.

Threading contract: only the engine thread touches the LLMEngine after start(). Callers talk to it
through a command queue (add / abort) and receive outputs on per-request asyncio queues. A request
whose caller goes away (cancelled task, closed HTTP stream) is aborted, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from densa.engine.llm_engine import LLMEngine
from densa.engine.metrics import EngineStats, snapshot
from densa.engine.output import RequestOutput
from densa.sampling_params import SamplingParams
from densa.utils.logging import get_logger

logger = get_logger(__name__)


class EngineOverloaded(RuntimeError):
    """Too many requests are queued; the caller should retry later (HTTP 429)."""


class EngineShuttingDown(RuntimeError):
    """The engine no longer accepts requests (HTTP 503)."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_scope: str
    session_id: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        scheduler_config = engine.config.scheduler
        self.max_in_flight = scheduler_config.max_num_seqs + (
            max_waiting_requests
            if max_waiting_requests is not None
            else scheduler_config.max_waiting_requests
        )
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]
        ] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self.num_steps = 0
        self.last_step_time = time.monotonic()
        # Replaced (never mutated) by the engine thread, so any thread may read it at any time.
        self.stats: EngineStats = snapshot(engine)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="densa-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish (up to drain_timeout), stop the thread."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_scope: str = "",
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield this request's outputs until the final one. Leaving early aborts the request."""
        request_id = request_id or self.engine.new_request_id()
        stream = self._open_stream(request_id, prompt_token_ids, params)
        self._send(_Add(request_id, list(prompt_token_ids), params, cache_scope, session_id))
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)
            self._close_stream(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def _open_stream(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> asyncio.Queue[RequestOutput]:
        if not self.is_accepting:
            raise EngineShuttingDown("the server is shutting down")
        self.engine.validate_request(prompt_token_ids, params)  # pure: safe from any thread
        with self._streams_lock:
            if len(self._streams) >= self.max_in_flight:
                raise EngineOverloaded(f"{len(self._streams)} requests in flight; retry shortly")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    def _close_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            self.stats = snapshot(self.engine, self.num_steps)
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug must not take the server down: fail what is in flight
                logger.exception("engine step failed; aborting all in-flight requests")
                outputs = self.engine.fail_all("engine_error: internal error during a step")
            self.num_steps += 1
            self.last_step_time = time.monotonic()
            self.stats = snapshot(self.engine, self.num_steps)
            self._dispatch(outputs)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            try:
                self.engine.add_request(
                    command.prompt_token_ids,
                    command.params,
                    request_id=command.request_id,
                    cache_scope=command.cache_scope,
                    session_id=command.session_id,
                )
            except ValueError as exc:
                self._dispatch([_error_output(command.request_id, str(exc))])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]
        ] = {}
        with self._streams_lock:
            for output in outputs:
                target = self._streams.get(output.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], output))
        for loop, items in by_loop.items():
            # A closed caller loop raises; its requests are aborted by their finally blocks.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)


def _error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        error=message,
        error_code="invalid_request",
    )
