"""The engine core on a thread of the caller's process, over inproc:// sockets.

Everything but the placement is as in `densa serve`: the same EngineCore, messages and codec
(engine/client.py speaks to it unchanged). Used where one process is the point: the
offline tools, benchmarks comparing against the split, and `densa serve --engine-placement
thread`. It cannot be restarted: a dead engine thread means a dead server.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq

from densa.engine.core import CoreOptions, EngineCore
from densa.engine.llm_engine import LLMEngine
from densa.ipc import transport


class _ThreadHandle:
    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def is_running(self) -> bool:
        return self.thread.is_alive()

    def exit_code(self) -> int | None:
        return None if self.thread.is_alive() else 0

    def kill(self) -> None:
        """A thread cannot be killed; it stops at the next Shutdown or when its sockets close."""

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)


@dataclass
class ThreadLauncher:
    engine: LLMEngine
    options: CoreOptions = field(default_factory=CoreOptions)
    can_restart: bool = False
    core: EngineCore | None = None  # the running core (tests look inside it)

    def make_addresses(self) -> transport.Addresses:
        return transport.Addresses.inproc()

    def start(self, addresses: transport.Addresses, context: zmq.Context) -> _ThreadHandle:
        self.core = EngineCore(self.engine, addresses, context, self.options)
        thread = threading.Thread(target=self.core.run, name="densa-engine", daemon=True)
        thread.start()
        return _ThreadHandle(thread)
