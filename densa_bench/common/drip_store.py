"""A stand-in for a slow or hostile shared KV store: a real TCP server on loopback that speaks
enough of Redis' protocol (RESP) to pass for one, and answers every GET by dripping it, one byte
every `drip_interval_s`, for at most `max_drip_s` (then it closes the connection). AUTH, SELECT,
PING, SET and EXISTS are answered at once, so a client's connect and writes work normally.

What it shows: a client whose socket timeout bounds each `recv` (redis-py's `socket_timeout`)
waits for the whole drip, since a byte comes well within every timeout; a client with a
deadline per call gives up at the deadline.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

_ANSWERS = {b"AUTH": b"+OK\r\n", b"SELECT": b"+OK\r\n", b"PING": b"+PONG\r\n",
            b"SET": b"+OK\r\n", b"EXISTS": b":0\r\n"}  # fmt: skip


class DripStore:
    def __init__(
        self, drip_interval_s: float = 0.05, max_drip_s: float = 30.0, value_bytes: int = 1 << 20
    ) -> None:
        self.drip_interval_s = drip_interval_s
        self.max_drip_s = max_drip_s
        self.value_bytes = value_bytes  # what the GET answer announces: far more than it sends
        self.num_gets = 0
        self.num_dripping = 0  # GET answers being dripped right now
        self._lock = threading.Lock()
        self._stop_dripping = threading.Event()
        self._closing = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # accept() looks at _closing this often
        self._threads: list[threading.Thread] = []
        self._connections: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"

    def start(self) -> DripStore:
        self._spawn(self._accept_loop)
        return self

    def stop_dripping(self) -> None:
        """End every drip now (and every later GET at once): the store closes the connection."""
        self._stop_dripping.set()

    def close(self) -> None:
        self._closing.set()
        self._stop_dripping.set()
        self._listener.close()
        with self._lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> DripStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the server --------------------------------------------------------------------------
    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener closed
                return
            connection.settimeout(None)
            with self._lock:
                self._connections.append(connection)
            self._spawn(self._serve, connection)

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as reader:
            while not self._closing.is_set():
                command = _read_command(reader)
                if command is None:
                    return
                name = command[0].upper()
                if name == b"GET":
                    self._drip(connection)
                    return  # a dripped answer ends the connection
                connection.sendall(_ANSWERS.get(name, b"-ERR unknown command\r\n"))

    def _drip(self, connection: socket.socket) -> None:
        with self._lock:
            self.num_gets += 1
            self.num_dripping += 1
        try:
            connection.sendall(b"$%d\r\n" % self.value_bytes)
            ends = time.monotonic() + self.max_drip_s
            while time.monotonic() < ends and not self._stop_dripping.wait(self.drip_interval_s):
                connection.sendall(b"x")
        except OSError:  # the client gave up and closed
            pass
        finally:
            with self._lock:
                self.num_dripping -= 1


def _read_command(reader: BinaryIO) -> list[bytes] | None:
    """One RESP array of bulk strings from the client, or None when it closed."""
    try:
        header = reader.readline()
        if not header.startswith(b"*"):
            return None
        parts = []
        for _ in range(int(header[1:])):
            length = int(reader.readline()[1:])
            parts.append(reader.read(length + 2)[:-2])
        return parts
    except (OSError, ValueError):
        return None
