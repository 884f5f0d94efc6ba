"""The engine core: an LLMEngine behind the message contract (ipc/messages.py).

It owns everything with tensors (scheduler, KV manager, model runner) and talks to a front only
through ZeroMQ: it takes AddRequest / AbortRequests, runs steps while there is work, and sends
each step's RequestDeltas with the engine's counters. A heartbeat thread sends the counters every
HEARTBEAT_INTERVAL_S, with how long the current step has been running, so the front can tell a
stuck step (one that never ends) from a long one. It beats mid-step only while the step lets it
run (the kernels release the GIL); the front reads death from the process, not from silence
(engine/client.py says why).

The same class runs in its own process (engine/core_process.py, what `densa serve` does) or on a
thread of the front's process (engine/inproc.py, for the offline API, tests and benchmarks).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from densa.auth.secret import load_secret
from densa.engine.disagg_port import KVAgents
from densa.engine.llm_engine import LLMEngine
from densa.engine.metrics import snapshot
from densa.ipc import codec, transport
from densa.ipc.messages import (
    AbortRequests,
    AddRequest,
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

HEARTBEAT_INTERVAL_S = 0.5
_IDLE_POLL_MS = 100  # how long an idle engine waits for a message before looking again


@dataclass(frozen=True)
class CoreOptions:
    allow_debug_controls: bool = False  # honour SetStepDelay (tests only)
    watch_parent_pid: int | None = None  # exit if this process (the front) goes away
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S


def served_model(engine: LLMEngine, role: str = "both", kv_address: str = "") -> ServedModel:
    """What the front needs to know, from the engine's resolved config."""
    config, arch = engine.config, engine.arch
    return ServedModel(
        name=config.model.served_model_name,
        max_model_len=config.scheduler.max_model_len,
        vocab_size=arch.vocab_size,
        eos_token_ids=engine.config.scheduler.eos_token_ids,
        tokenizer=engine.tokenizer.files,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_waiting_requests=config.scheduler.max_waiting_requests,
        page_size=config.cache.page_size,
        num_kv_pages=config.cache.num_pages,
        kv_format=engine.kv_format,
        weight_format=engine.weight_format,
        architecture=arch.signature(),
        engine_pid=os.getpid(),
        role=role,
        kv_address=kv_address,
    )


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        addresses: transport.Addresses,
        context: zmq.Context,
        options: CoreOptions = CoreOptions(),
    ) -> None:
        self.engine = engine
        self.addresses = addresses
        self.options = options
        self._context = context
        self._stopping = False
        self._step_delay = SetStepDelay(0.0)
        self._step_started: float | None = None  # monotonic time the running step began
        self.num_steps = 0
        disagg = engine.config.disagg  # the role (engine/disagg_port.py) and its KV link
        self.kv_agents = KVAgents.for_role(
            engine, disagg.role, context, disagg.kv_listen, disagg.kv_transfer_timeout,
            load_secret(disagg.cluster_secret_file) if disagg.role != "both" else None,
        )  # fmt: skip
        self.stats: EngineStats = self._snapshot()  # replaced, never mutated: safe to share

    # ---- the loop --------------------------------------------------------------------------------
    def run(self, on_ready: Callable[[], None] = lambda: None) -> None:
        """Say hello, then serve until Shutdown (or the front goes away). Closes its sockets."""
        requests = transport.configure(self._context.socket(zmq.PULL))
        outputs = transport.configure(self._context.socket(zmq.PUSH))
        requests.connect(self.addresses.requests)
        outputs.connect(self.addresses.outputs)
        beat = threading.Thread(target=self._heartbeat, name="densa-heartbeat", daemon=True)
        try:
            self.engine.warm_up()
            hello = served_model(self.engine, self.kv_agents.role, self.kv_agents.address)
            self._send(outputs, Hello(hello))
            on_ready()
            beat.start()
            poller = zmq.Poller()
            for socket in [requests, *self.kv_agents.waitables()]:
                poller.register(socket, zmq.POLLIN)
            while not self._stopping:
                applied = self._take_messages(requests, outputs, poller)
                # Every turn, idle or not, so transfer deadlines fire on time; what the agents
                # (or new requests) changed shows in the stats the heartbeat sends, even if no
                # step follows (a request waiting for its pages is not stepped).
                changed = self.kv_agents.poll() or applied
                if changed:
                    self.stats = self._snapshot()
                # Requests waiting only for their KV pages to land need no step.
                if not self._stopping and self.engine.has_runnable_work():
                    self._send(outputs, self._step())
                elif changed:
                    # No step follows to carry the new stats, and a phase shorter than the
                    # heartbeat (a transfer in flight) would go unseen by the front and the
                    # router: send them now.
                    self._send(outputs, StepOutputs([], self.stats))
        finally:
            self._stopping = True
            requests.close()
            outputs.close()
            self.kv_agents.close()
        logger.info("engine core stopped after %d steps", self.num_steps)

    def _step(self) -> StepOutputs:
        self._step_started = time.monotonic()
        try:
            if self._step_delay.seconds:  # a slower step, as far as anyone can tell
                _delay(self._step_delay)
            deltas = self.engine.step()
        except Exception:  # outside any request (those are confined inside step): fail them all
            logger.exception("engine step failed outside any request; failing all in flight")
            deltas = self.engine.fail_all("engine_error: internal error in the engine's step")
        finally:
            self._step_started = None
        self.num_steps += 1
        self.stats = self._snapshot()
        return StepOutputs(self.kv_agents.take_outputs(deltas), self.stats)

    def _snapshot(self) -> EngineStats:
        stats = snapshot(self.engine, self.num_steps)
        disagg = self.kv_agents.stats()
        return msgspec.structs.replace(stats, disagg=disagg) if disagg else stats

    def _take_messages(self, requests: zmq.Socket, outputs: zmq.Socket, poller: zmq.Poller) -> bool:
        """Apply every message waiting (returns whether there was one); if nothing can be
        computed, first wait up to _IDLE_POLL_MS for a message from the front or a KV peer."""
        idle = not self.engine.has_runnable_work()
        if idle and not any(poller.poll(_IDLE_POLL_MS)):
            return False
        if not requests.poll(0):
            return False
        refused: list[RequestDelta] = []
        while True:
            try:
                data = requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            refused += self._apply(codec.decode_to_engine(data))
        if refused:  # answered at once, not after the next step
            self._send(outputs, StepOutputs(refused, self.stats))
        return True

    def _apply(self, message: ToEngine) -> list[RequestDelta]:
        if isinstance(message, AddRequest):
            return self._add(message)
        if isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.engine.abort_request(request_id)
        elif isinstance(message, SetStepDelay):
            if self.options.allow_debug_controls:
                self._step_delay = message
        elif isinstance(message, Shutdown):
            self._stopping = True
        return []

    def _add(self, message: AddRequest) -> list[RequestDelta]:
        decode = self.kv_agents.decode
        # Structured outputs run locally: their grammar state would have to cross workers too.
        remote = bool(message.prefill_address) and message.params.structured is None
        if remote and decode is None:
            return [_refusal(message.request_id, "this engine is not a decode worker")]
        try:
            self.engine.add_request(
                message.prompt_token_ids,
                message.params,
                request_id=message.request_id,
                cache_scope=message.cache_scope,
                session_id=message.session_id,
                remote_prefill=remote,
            )
        except ValueError as exc:  # the front validates too: this is its safety net
            return [_refusal(message.request_id, str(exc))]
        if remote and decode is not None:
            decode.start(message.request_id, message.prefill_address)
        return []

    # ---- liveness --------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        """Own socket (ZeroMQ sockets are not thread-safe); beats until the loop stops."""
        socket = transport.configure(self._context.socket(zmq.PUSH))
        socket.connect(self.addresses.outputs)
        try:
            while not self._stopping:
                self._check_parent()
                started = self._step_started
                running = 0.0 if started is None else time.monotonic() - started
                self._send(socket, Heartbeat(self.num_steps, running, self.stats))
                time.sleep(self.options.heartbeat_interval_s)
        finally:
            socket.close()

    def _check_parent(self) -> None:
        parent = self.options.watch_parent_pid
        if parent is not None and os.getppid() != parent:
            # The front died without a word (kill -9): nobody is left to serve. Exit hard, as
            # a thread cannot stop the main loop mid-step.
            logger.error("the front process %d is gone; the engine exits", parent)
            os._exit(1)

    @staticmethod
    def _send(socket: zmq.Socket, message: FromEngine) -> None:
        socket.send(codec.encode(message), copy=False)


def _delay(delay: SetStepDelay) -> None:
    seconds = max(0.0, delay.seconds)
    if delay.hold_gil:  # libc's usleep called through a PyDLL keeps the GIL while it sleeps
        ctypes.PyDLL(None).usleep(int(seconds * 1e6))
    else:
        time.sleep(seconds)


def _refusal(request_id: str, message: str) -> RequestDelta:
    return RequestDelta(
        request_id=request_id,
        new_token_ids=[],
        finished=True,
        finish_reason="error",
        error=message,
        error_code="invalid_request",
    )
