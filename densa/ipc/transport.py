"""ZeroMQ sockets between a front and an engine core: where they live and who binds.

    front                                  engine core
    PUSH  requests  --(ToEngine)-->   PULL  (main loop)
    PULL  outputs   <--(FromEngine)-- PUSH  (main loop: Hello, StepOutputs)
                                       PUSH  (heartbeat thread: Heartbeat)

The front binds both sockets and the engine connects, so an engine can be restarted (or run on
another host) without the front changing address. The same code serves three placements, told
apart only by the address scheme:

    inproc://   an engine thread in the front's process (one ZeroMQ context shared)
    ipc://      an engine process on this host (Unix sockets in a private temp folder)
    tcp://      an engine anywhere on the network
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq

# Outputs are small and frequent: never drop one. HWM 0 = unbounded queues (memory is bounded by
# the requests in flight, which the front caps).
_HIGH_WATER_MARK = 0


@dataclass(frozen=True)
class Addresses:
    requests: str  # front -> engine
    outputs: str  # engine -> front

    @classmethod
    def inproc(cls) -> Addresses:
        tag = uuid.uuid4().hex
        return cls(f"inproc://densa-requests-{tag}", f"inproc://densa-outputs-{tag}")

    @classmethod
    def ipc(cls, folder: Path | None = None) -> Addresses:
        """Unix sockets in a fresh folder only this user can enter (0700)."""
        folder = Path(folder or tempfile.mkdtemp(prefix="densa-ipc-"))
        os.chmod(folder, 0o700)
        return cls(f"ipc://{folder}/requests", f"ipc://{folder}/outputs")

    @classmethod
    def tcp(cls, host: str, requests_port: int, outputs_port: int) -> Addresses:
        return cls(f"tcp://{host}:{requests_port}", f"tcp://{host}:{outputs_port}")


def configure(socket: zmq.Socket) -> zmq.Socket:
    socket.setsockopt(zmq.SNDHWM, _HIGH_WATER_MARK)
    socket.setsockopt(zmq.RCVHWM, _HIGH_WATER_MARK)
    socket.setsockopt(zmq.LINGER, 0)  # closing drops what a dead peer will never read
    return socket


def bound_address(socket: zmq.Socket, address: str) -> str:
    """Bind, and return the address peers must connect to (tcp port 0 -> the chosen port)."""
    socket.bind(address)
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def remove_ipc_files(addresses: Addresses) -> None:
    """Unix socket files outlive their sockets: remove them and their folder once done."""
    for address in (addresses.requests, addresses.outputs):
        if address.startswith("ipc://"):
            Path(address.removeprefix("ipc://")).unlink(missing_ok=True)
    if addresses.requests.startswith("ipc://"):
        folder = Path(addresses.requests.removeprefix("ipc://")).parent
        if folder.name.startswith("densa-ipc-"):
            with contextlib.suppress(OSError):  # not empty: someone else's files, leave it
                folder.rmdir()
