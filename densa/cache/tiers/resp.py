"""A Redis client with a hard deadline on every call, for the shared KV tier (shared.py).

Why not redis-py: its `socket_timeout` bounds each `recv`, not the call, so a store that drips
its answer one byte at a time (a hostile or broken server, a congested link) holds a GET as long
as it likes. Here one deadline covers the whole call: the TCP connect, AUTH and SELECT on a new
connection, sending the command and reading the whole answer. Past it the call fails with
StoreTimeout and its connection is closed (its stream is no longer in step with the store).
Name resolution is the one part no socket timeout bounds: give the store as an IP address, or
rely on the engine's own deadline per lookup (engine/kv_tiers.py), which never waits on a call.

It speaks the part of RESP2 the tier needs: commands as arrays of bulk strings; simple strings,
errors, integers and bulk strings back. An answer is capped (max_value_bytes), so a store cannot
make the process buffer without bound. One connection per thread (each reader thread and the
writer have their own), made on first use.

Nothing here repeats a secret: a StoreAddress prints without its password, errors name only the
store's location, and a store's error reply is reduced to its first word (WRONGPASS, NOAUTH...).
"""

from __future__ import annotations

import socket
import threading
import time

from densa.cache.tiers.tier import StoreAddress

MAX_VALUE_BYTES = 64 << 20  # the default cap on one answer
MAX_LINE_BYTES = 4096  # the longest status, error or length line read before giving up
_RECV_BYTES = 1 << 16

Reply = bytes | str | int | None


class StoreError(Exception):
    """A call that failed (unreachable, refused, malformed answer); the message has no secret."""


class StoreTimeout(StoreError):
    """A call that did not end by its deadline."""


class RespClient:
    """GET, SET and EXISTS against one store, each bounded by `timeout_s` from start to end."""

    def __init__(
        self, address: StoreAddress, timeout_s: float, max_value_bytes: int = MAX_VALUE_BYTES
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_value_bytes = max_value_bytes
        self._local = threading.local()  # .connection: this thread's, or None
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()  # every thread's, for close()

    def get(self, key: bytes) -> bytes | None:
        reply = self._call(b"GET", key)
        if reply is not None and not isinstance(reply, bytes):
            raise StoreError(f"{self.address.location}: an unexpected answer to GET")
        return reply

    def set(self, key: bytes, value: bytes | memoryview) -> None:
        if self._call(b"SET", key, value) != "OK":
            raise StoreError(f"{self.address.location}: an unexpected answer to SET")

    def exists(self, key: bytes) -> bool:
        reply = self._call(b"EXISTS", key)
        if not isinstance(reply, int):
            raise StoreError(f"{self.address.location}: an unexpected answer to EXISTS")
        return reply > 0

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            connection.close()

    def _call(self, *args: bytes | memoryview) -> Reply:
        deadline = time.monotonic() + self.timeout_s
        location = self.address.location
        try:
            connection = getattr(self._local, "connection", None)
            if connection is not None and connection.is_stale():
                self._drop_this_threads()  # closed by the store (a restart) while it sat idle
                connection = None
            connection = connection or self._connect(deadline)
            return connection.call(args, deadline)
        except StoreError as exc:
            self._drop_this_threads()
            raise StoreError(f"{location}: {exc}") from None
        except TimeoutError:
            self._drop_this_threads()
            raise StoreTimeout(f"{location}: no whole answer within {self.timeout_s:g} s") from None
        except (OSError, ValueError) as exc:  # ValueError: a length or number that is not one
            self._drop_this_threads()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "bad answer"
            raise StoreError(f"{location}: {reason}") from None

    def _connect(self, deadline: float) -> _Connection:
        address = self.address
        sock = socket.create_connection((address.host, address.port), _remaining(deadline))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(sock, self.max_value_bytes)
        with self._lock:
            self._connections.add(connection)
        self._local.connection = connection
        if address.password:  # AUTH PASSWORD, or AUTH USER PASSWORD (Redis 6 ACLs)
            user = [address.username.encode()] if address.username else []
            connection.expect_ok((b"AUTH", *user, address.password.encode()), deadline)
        if address.db:
            connection.expect_ok((b"SELECT", str(address.db).encode()), deadline)
        return connection

    def _drop_this_threads(self) -> None:
        """Close this thread's connection after a failed call: whatever the store sends next
        would be read as the answer to another command."""
        connection = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is not None:
            with self._lock:
                self._connections.discard(connection)
            connection.close()


class _Connection:
    """One socket to the store and the bytes read from it but not yet parsed."""

    def __init__(self, sock: socket.socket, max_value_bytes: int) -> None:
        self.sock = sock
        self.max_value_bytes = max_value_bytes
        self.buffer = bytearray()

    def is_stale(self) -> bool:
        """Has the store closed this idle connection, or sent something nobody asked for? A
        healthy idle connection has nothing to read (each answer is read with its command)."""
        if self.buffer:
            return True
        self.sock.settimeout(0)  # look, do not wait
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True  # end of stream, or unasked bytes

    def call(self, args: tuple[bytes | memoryview, ...], deadline: float) -> Reply:
        self.sock.settimeout(_remaining(deadline))
        self.sock.sendall(_command(args))  # the timeout bounds the whole sendall (Python 3.5+)
        return self.read_reply(deadline)

    def expect_ok(self, args: tuple[bytes, ...], deadline: float) -> None:
        if self.call(args, deadline) != "OK":
            raise StoreError(f"unexpected answer to {args[0].decode()}")

    def read_reply(self, deadline: float) -> Reply:
        line = self._read_line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode("ascii", "replace")
        if kind == b"-":  # only the error's code: the rest is the store's text
            code = rest.split(b" ", 1)[0].decode("ascii", "replace")[:32]
            raise StoreError(f"the store answered {code!r}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return self._read_bulk(int(rest), deadline)
        raise StoreError("an answer the shared tier does not speak")

    def close(self) -> None:
        self.sock.close()

    def _read_bulk(self, length: int, deadline: float) -> bytes | None:
        if length == -1:  # nil: no such key
            return None
        if not 0 <= length <= self.max_value_bytes:
            raise StoreError(f"an answer of {length} bytes (the cap is {self.max_value_bytes})")
        data = self._read_exact(length + 2, deadline)
        if data[-2:] != b"\r\n":
            raise StoreError("a malformed answer")
        return bytes(data[:-2])

    def _read_line(self, deadline: float) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 2]
                return line
            if len(self.buffer) > MAX_LINE_BYTES:
                raise StoreError("an answer line longer than any the tier expects")
            self.buffer += self._recv(deadline)

    def _read_exact(self, num_bytes: int, deadline: float) -> bytearray:
        out = bytearray(num_bytes)
        taken = min(num_bytes, len(self.buffer))
        out[:taken] = self.buffer[:taken]
        del self.buffer[:taken]
        view = memoryview(out)
        while taken < num_bytes:
            self.sock.settimeout(_remaining(deadline))
            got = self.sock.recv_into(view[taken:])
            if not got:
                raise StoreError("the store closed the connection")
            taken += got
        return out

    def _recv(self, deadline: float) -> bytes:
        self.sock.settimeout(_remaining(deadline))  # what is left of the call, not a fresh timeout
        chunk = self.sock.recv(_RECV_BYTES)
        if not chunk:
            raise StoreError("the store closed the connection")
        return chunk


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _command(args: tuple[bytes | memoryview, ...]) -> bytes:
    parts: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts += [b"$%d\r\n" % len(arg), arg, b"\r\n"]
    return b"".join(parts)
