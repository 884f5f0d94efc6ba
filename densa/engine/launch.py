"""Starting an engine life and reading what it sends: the client's plumbing (engine/client.py).

An engine is started by a launcher -- its own process on this host by default, a thread where one
process is the point (engine/inproc.py) -- and known to the client only through its handle; its
outputs are read on a thread of their own (`OutputReceiver`), so the event loop never waits on
the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from densa.ipc import codec, transport
from densa.ipc.messages import FromEngine


# ---- launching an engine ------------------------------------------------------------------------
class EngineHandle(Protocol):
    def is_running(self) -> bool:
        """Whether the engine lives: the front trusts this, not silence, to declare it dead."""
        ...

    def exit_code(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float) -> None: ...


class EngineLauncher(Protocol):
    """Starts an engine core that connects to `addresses` (the client has bound them)."""

    can_restart: bool

    def start(self, addresses: transport.Addresses, context: zmq.Context) -> EngineHandle: ...

    def make_addresses(self) -> transport.Addresses: ...


class ProcessHandle:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def is_running(self) -> bool:
        return self.process.poll() is None

    def exit_code(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def wait(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class ProcessLauncher:
    """The engine core in its own process on this host (`python -m densa.engine.core_process`).

    Its options travel through a pipe it inherits (`--engine-args-fd`), not its command line:
    they may hold secrets (a shared KV tier's URL with the store's password), and every user of
    the host can read any process's command line (`ps`, /proc/PID/cmdline). The environment
    (DENSA_CLUSTER_SECRET, DENSA_KV_TIER_PASSWORD) is inherited as usual: only its owner and
    root can read /proc/PID/environ.
    """

    engine_args: dict[str, Any]  # EngineArgs fields
    debug_controls: bool = False  # let tests slow steps down (SetStepDelay)
    log_level: str = "info"
    can_restart: bool = True

    def make_addresses(self) -> transport.Addresses:
        return transport.Addresses.ipc()

    def start(self, addresses: transport.Addresses, context: zmq.Context) -> EngineHandle:
        read_fd, write_fd = os.pipe()
        command = [
            sys.executable, "-m", "densa.engine.core_process",
            "--engine-args-fd", str(read_fd),
            "--requests", addresses.requests, "--outputs", addresses.outputs,
            "--parent-pid", str(os.getpid()), "--log-level", self.log_level,
        ]  # fmt: skip
        if self.debug_controls:
            command.append("--debug-controls")
        try:
            process = subprocess.Popen(command, pass_fds=(read_fd,))
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)  # the child holds its own copy
        _send_and_close(write_fd, json.dumps(self.engine_args).encode())
        return ProcessHandle(process)


def _send_and_close(fd: int, data: bytes) -> None:
    """Write `data` into the pipe and close it (the child reads to the end first thing, so this
    returns at once; a child that died before reading leaves nothing to tell)."""
    with contextlib.suppress(BrokenPipeError), os.fdopen(fd, "wb") as pipe:
        pipe.write(data)


class OutputReceiver:
    """Reads the outputs socket on its own thread and hands what it decodes to the event loop."""

    def __init__(
        self,
        socket: Any,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[list[FromEngine]], None],
    ) -> None:
        self._socket = socket  # PULL; from start() on, only this thread touches it
        self._loop = loop
        self._deliver = deliver
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="densa-engine-outputs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._socket.poll(50):
                    continue
                batch = []
                while True:
                    try:
                        batch.append(codec.decode_from_engine(self._socket.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                self._loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the event loop closed under us: the client is gone
            pass
        finally:
            self._socket.close(linger=0)
