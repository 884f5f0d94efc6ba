"""The front's handle on an engine core: typed messages over ZeroMQ, liveness, restarts.

Torch-free: it knows the engine only through the contract (ipc/messages.py). One client owns one
engine "life" at a time -- a launched engine (a process, by default) and the two sockets it talks
through. Requests stream RequestDeltas back on per-request asyncio queues.

Failure semantics (docs/architecture.md):
- the engine process exits, or one step runs for `step_timeout_s` (stuck: it is killed) -> every
  request in flight ends at once with `engine_unavailable`, `/health` answers 503, and a new
  engine is started; new requests get 503 until it has loaded;
- more than `max_restarts` lives that each ended within `restart_window_s` -> the client gives up
  (`has_failed`), and `densa serve` exits non-zero so a supervisor can take over.
A new life gets new sockets, so nothing a dead engine left queued reaches its successor.

Liveness does not depend on step length. Death is read from the engine itself (its handle: a
process exit, kill -9 included, is seen within _MONITOR_INTERVAL_S), never inferred from silence.
The heartbeat is a Python thread: it beats every 0.5 s, with how long the running step has gone
on, only while the step lets it run. densa's kernels release the GIL, but a call that keeps it (a
torch op or extension that does not release it) silences the engine for as long as it lasts; at
real model size that is seconds, and a silence deadline killed healthy engines (issue 21: "the
engine sent nothing for 3.1 s", all 16 requests at c=8 failed). Pausing the deadline while a
step runs cannot work: the beat that would say a step began is the one that cannot be sent. So a
silent engine whose process lives is taken to be in a step: its silence adds to the step's last
reported running time, and `step_timeout_s` judges it as it judges a step that beats (an engine
frozen or wedged for good is still replaced, after that timeout); silence past
`heartbeat_timeout_s` is only logged.

Threads: outputs are received and decoded on a thread of their own (blocking ZeroMQ reads; the
decoded messages are handed to the event loop in batches), so the event loop never waits on the
socket and never misses a wake-up; requests are sent from the event loop (sends never block:
the queues are unbounded and the client caps the requests in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import zmq

from densa.engine.launch import EngineHandle, EngineLauncher, OutputReceiver
from densa.ipc import codec, transport
from densa.ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineStats,
    FromEngine,
    Heartbeat,
    Hello,
    RequestDelta,
    ServedModel,
    SetStepDelay,
    Shutdown,
    StepOutputs,
    ToEngine,
)
from densa.utils.logging import get_logger

logger = get_logger(__name__)

ENGINE_UNAVAILABLE = "engine_unavailable"
_MONITOR_INTERVAL_S = 0.1


class EngineOverloaded(RuntimeError):
    """Too many requests are in flight; the caller should retry later (HTTP 429)."""


class EngineShuttingDown(RuntimeError):
    """The server is draining and accepts no new requests (HTTP 503)."""


class EngineUnavailable(RuntimeError):
    """No engine is running right now (it is starting, restarting, or gave up) (HTTP 503)."""


class EngineStartError(RuntimeError):
    """The engine could not be started (its one-line reason is the message)."""


# ---- the client ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientOptions:
    heartbeat_timeout_s: float = 3.0  # a living engine silent this long is logged (GIL held)
    step_timeout_s: float = 120.0  # one step this long: the engine is stuck (killed)
    start_timeout_s: float = 900.0  # loading the model (a first GGUF conversion takes minutes)
    max_restarts: int = 3  # engines that died young in a row before the client gives up
    restart_window_s: float = 600.0  # an engine that lived longer than this resets the count


class _Gone:
    """Put on a stream whose engine went away."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass
class _Life:
    """One running engine and the sockets it talks through."""

    addresses: transport.Addresses
    requests: Any  # PUSH, used by the event loop only
    receiver: OutputReceiver
    handle: EngineHandle | None = None
    started_at: float = 0.0
    last_heard: float = 0.0
    step_running_s: float = 0.0  # as of last_heard: the last heartbeat's, 0 after a step's outputs
    silence_logged: bool = False


class EngineClient:
    def __init__(self, launcher: EngineLauncher, options: ClientOptions = ClientOptions()) -> None:
        self.launcher = launcher
        self.options = options
        self.context = zmq.Context()
        self._life: _Life | None = None
        self._served: ServedModel | None = None
        self.stats = EngineStats()
        self.state = "new"  # new | starting | running | restarting | stopping | stopped | failed
        self.failure: str | None = None  # why the client gave up (state "failed")
        self._streams: dict[str, asyncio.Queue[RequestDelta | _Gone]] = {}
        self._hello: asyncio.Future[ServedModel] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._short_lives = 0
        self.num_restarts = 0
        self.on_failed: Callable[[], None] = lambda: None  # the server exits non-zero

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> ServedModel:
        """Launch the engine and wait for its Hello (raises EngineStartError)."""
        self.state = "starting"
        self._served = await self._start_life()
        self.state = "running"
        self._tasks.append(asyncio.create_task(self._monitor(), name="densa-engine-monitor"))
        return self._served

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Let running requests finish (up to drain_timeout), then stop the engine cleanly."""
        if self.state in ("stopped", "new"):
            return
        deadline = time.monotonic() + drain_timeout
        while self._streams and self.state == "running" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failed = self.state == "failed"
        self.state = "stopping"
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        life, self._life = self._life, None
        if life is not None:
            with contextlib.suppress(zmq.ZMQError):
                life.requests.send(codec.encode(Shutdown()), zmq.NOBLOCK)
            if life.handle is not None:
                await asyncio.to_thread(life.handle.wait, 10.0)
            self._close(life)
        self._fail_streams("the server shut down before the request finished")
        self.state = "failed" if failed else "stopped"  # a failure stays visible to the caller

    @property
    def served(self) -> ServedModel:
        if self._served is None:
            raise EngineUnavailable("the engine has not started yet")
        return self._served

    @property
    def is_alive(self) -> bool:
        return self.state == "running"

    @property
    def has_failed(self) -> bool:
        return self.state == "failed"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def max_in_flight(self) -> int:
        return self.served.max_num_seqs + self.served.max_waiting_requests

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, request: AddRequest) -> AsyncGenerator[RequestDelta, None]:
        """Send the request and yield its deltas until the final one. Leaving early aborts it.
        If the engine goes away meanwhile, the last delta is an `engine_unavailable` error."""
        queue = self._open(request.request_id)
        finished = False
        try:
            self._send(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, _Gone):
                    finished = True
                    yield _unavailable(request.request_id, item.reason)
                    return
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self._life is not None and self.state == "running":
            self._send(AbortRequests([request_id]))

    async def set_step_delay(self, seconds: float, hold_gil: bool = False) -> None:
        """Tests: slow every engine step (honoured only by engines started with debug controls);
        `hold_gil`: sleep keeping the GIL, which silences the engine's heartbeat."""
        self._send(SetStepDelay(seconds, hold_gil))

    def _open(self, request_id: str) -> asyncio.Queue[RequestDelta | _Gone]:
        if self.state == "stopping":
            raise EngineShuttingDown("the server is shutting down")
        if self.state != "running":
            raise EngineUnavailable(self._unavailable_reason())
        if len(self._streams) >= self.max_in_flight:
            raise EngineOverloaded(f"{len(self._streams)} requests in flight; retry shortly")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestDelta | _Gone] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def _send(self, message: ToEngine) -> None:
        """Queue a message for the engine; never blocks (unbounded queue, requests capped)."""
        if self._life is None:
            raise EngineUnavailable(self._unavailable_reason())
        self._life.requests.send(codec.encode(message), zmq.NOBLOCK)

    def _unavailable_reason(self) -> str:
        if self.state == "failed":
            return f"the engine failed and was not restarted: {self.failure}"
        return "the engine is starting; retry shortly"

    # ---- one engine life -------------------------------------------------------------------------
    async def _start_life(self) -> ServedModel:
        addresses = self.launcher.make_addresses()
        requests = transport.configure(self.context.socket(zmq.PUSH))
        outputs = transport.configure(self.context.socket(zmq.PULL))
        addresses = transport.Addresses(
            transport.bound_address(requests, addresses.requests),
            transport.bound_address(outputs, addresses.outputs),
        )
        loop = asyncio.get_running_loop()
        life = _Life(
            addresses, requests, OutputReceiver(outputs, loop, lambda b: self._take(life, b))
        )
        self._life = life
        self._hello = loop.create_future()
        life.receiver.start()
        life.handle = self.launcher.start(addresses, self.context)
        life.started_at = life.last_heard = time.monotonic()
        try:
            served = await self._await_hello(life)
        except BaseException:
            if life.handle is not None:
                await asyncio.to_thread(life.handle.kill)
            self._close(life)
            self._life = None
            raise
        life.last_heard = time.monotonic()
        return served

    async def _await_hello(self, life: _Life) -> ServedModel:
        assert self._hello is not None
        deadline = time.monotonic() + self.options.start_timeout_s
        while True:
            done, _ = await asyncio.wait({self._hello}, timeout=0.2)
            if done:
                return self._hello.result()
            assert life.handle is not None
            if not life.handle.is_running():
                code = life.handle.exit_code()
                raise EngineStartError(f"the engine exited with code {code} before it was ready")
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"the engine was not ready within {self.options.start_timeout_s:g} s"
                )

    def _take(self, life: _Life, batch: list[FromEngine]) -> None:
        """On the event loop: route one batch of the engine's messages."""
        if life is not self._life:
            return  # a dead life's last words
        life.last_heard = time.monotonic()
        life.silence_logged = False
        for message in batch:
            if isinstance(message, StepOutputs):
                self.stats = message.stats
                life.step_running_s = 0.0  # sent between steps
                for delta in message.deltas:
                    queue = self._streams.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(message, Heartbeat):
                self.stats = message.stats
                life.step_running_s = message.step_running_s
            else:
                self._answer_hello(message)

    def _answer_hello(self, message: Hello | EngineFailed) -> None:
        if self._hello is None or self._hello.done():
            return
        if isinstance(message, Hello):
            self._hello.set_result(message.served)
        else:
            self._hello.set_exception(EngineStartError(message.message))

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(_MONITOR_INTERVAL_S)
            life = self._life
            if self.state != "running" or life is None:
                continue
            problem = self._problem(life)
            if problem is not None:
                await self._lost(life, problem)

    def _problem(self, life: _Life) -> str | None:
        """Why this life is over, or None: the engine exited, or its step is stuck (see the
        module docstring: silence from a living engine is a step that holds the GIL)."""
        assert life.handle is not None
        if not life.handle.is_running():
            return f"the engine exited (code {life.handle.exit_code()})"
        silent = time.monotonic() - life.last_heard
        running = life.step_running_s + silent
        if running > self.options.step_timeout_s:
            return f"an engine step has run for {running:.0f} s (stuck)"
        if silent > self.options.heartbeat_timeout_s and not life.silence_logged:
            life.silence_logged = True
            logger.warning(
                "the engine has sent nothing for %.1f s but is alive: a step holding the GIL; "
                "it is stuck only past %g s", silent, self.options.step_timeout_s,
            )  # fmt: skip
        return None

    async def _lost(self, life: _Life, problem: str) -> None:
        logger.error("%s: failing %d requests in flight", problem, len(self._streams))
        self.state = "restarting"
        self._fail_streams(f"{problem}; the request could not be completed, retry it")
        if life.handle is not None:
            await asyncio.to_thread(life.handle.kill)
        self._close(life)
        self._life = None
        short = time.monotonic() - life.started_at < self.options.restart_window_s
        self._short_lives = self._short_lives + 1 if short else 1
        if not self.launcher.can_restart or self._short_lives > self.options.max_restarts:
            self._give_up(problem)
            return
        try:
            served = await self._start_life()
        except (EngineStartError, OSError) as exc:
            self._give_up(f"{problem}, and restarting it failed: {exc}")
            return
        if served.name != self.served.name or served.vocab_size != self.served.vocab_size:
            self._give_up("the restarted engine serves another model")
            return
        self._served = served
        self.num_restarts += 1
        self.state = "running"
        logger.info("engine restarted (%d restarts so far)", self.num_restarts)

    def _give_up(self, reason: str) -> None:
        logger.error("giving up on the engine: %s", reason)
        self.state, self.failure = "failed", reason
        self.on_failed()

    def _fail_streams(self, reason: str) -> None:
        for queue in self._streams.values():
            queue.put_nowait(_Gone(reason))

    def _close(self, life: _Life) -> None:
        life.receiver.stop()  # closes the outputs socket on its own thread
        life.requests.close(linger=0)
        transport.remove_ipc_files(life.addresses)


def _unavailable(request_id: str, reason: str) -> RequestDelta:
    return RequestDelta(
        request_id=request_id,
        new_token_ids=[],
        finished=True,
        finish_reason="error",
        error=f"{ENGINE_UNAVAILABLE}: {reason}",
        error_code=ENGINE_UNAVAILABLE,
    )
