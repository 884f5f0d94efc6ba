"""A real redis-server process for the shared KV tier's tests and `densa bench tiers`: started on
a free loopback port with a memory cap and LRU eviction (what a deployment should configure), no
persistence (a cache), and killed (SIGKILL) or restarted on the same port on demand."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

INSTALL_HINT = (
    "redis-server is not installed: run scripts/setup.sh dev (apt-get install redis-server)"
)


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )


class RedisServer:
    def __init__(
        self, maxmemory: str = "256mb", port: int | None = None, password: str = ""
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = binary
        self.maxmemory = maxmemory
        self.port = port or _free_port()
        self.password = password  # --requirepass (given in its config on stdin, not its argv)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        # "-": the config comes on stdin, so a password is in no process' command line.
        self.proc = subprocess.Popen(
            [self.binary, "-", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert self.proc.stdin is not None
        config = f'requirepass "{self.password}"\n' if self.password else ""
        self.proc.stdin.write(config.encode())
        self.proc.stdin.close()
        client = redis.Redis(port=self.port, password=self.password or None, socket_timeout=0.5,
                             socket_connect_timeout=0.5)  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    return self
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, nothing saved."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
