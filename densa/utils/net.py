"""Listening sockets, bound before anything slow so a busy or invalid port fails at once."""

from __future__ import annotations

import socket


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening. Raises ValueError / OSError with a
    message that says what to do."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port (0-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise OSError(f"cannot listen on {host}:{port}: {reason}; pick another --port") from exc
    return sock
