"""The servers `densa bench peers` compares: how each is started, what formats it runs, its memory.

Every peer is a separate OpenAI-compatible server process on loopback: densa's own `densa serve`,
llama.cpp's `llama-server` (built by `scripts/setup.sh peers`), and transformers' `transformers
serve` with continuous batching. The benchmark talks to all of them through one client
(openai_load.py), so nothing engine-specific sits between the clock and the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from densa_bench.common.openai_load import Endpoint

_RESET_PEAK_RSS = "5"  # Linux /proc/<pid>/clear_refs code: reset VmHWM (the peak RSS)


@dataclass(frozen=True)
class PeerSpec:
    """One server configuration under test.

    argv may contain '{port}', filled in at start. formats names what the engine computes with
    (weights, output head, KV cache, compute dtype), so equal-bits rows can be told apart.
    """

    name: str  # row label, e.g. "llama.cpp Q4_1"
    engine: str  # "densa" | "llama.cpp" | "transformers" | anything for fakes
    argv: tuple[str, ...]
    model: str  # the model id requests name
    formats: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)  # see Endpoint
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/v1/models"  # 200 once the model is loaded
    start_timeout_s: float = 900.0  # first starts convert or compile models


class PeerServer:
    """A running peer: started on a free port, stopped (and reaped) on exit."""

    def __init__(self, spec: PeerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.log_path = log_dir / f"{_slug(spec.name)}.log"
        self._log: IO[bytes] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{self.port}/v1", self.spec.model, self.spec.extra_body)

    def start(self) -> None:
        argv = [part.replace("{port}", str(self.port)) for part in self.spec.argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.spec.env},
            start_new_session=True,  # its own process group: stop() reaches its children too
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        url = f"http://127.0.0.1:{self.port}{self.spec.ready_path}"
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.name} exited with {self.process.returncode} while starting; "
                    f"see {self.log_path}:\n{_tail(self.log_path)}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(url, timeout=5) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"{self.spec.name} was not ready after {self.spec.start_timeout_s} s")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    # ---- memory --------------------------------------------------------------------------------
    # A server may be several processes (densa: the HTTP front and its engine process), so each
    # figure sums the process tree: the peaks of processes that peaked at different moments add
    # up to a little more than the tree ever held at once (an upper bound).
    def reset_peak_rss(self) -> int:
        """Reset the peak-RSS marks of the server's processes (Linux); returns their RSS now
        (0 where unknown)."""
        for pid in self.process_ids():
            with contextlib.suppress(OSError):
                Path(f"/proc/{pid}/clear_refs").write_text(_RESET_PEAK_RSS)
        return sum(status_kib(pid, "VmRSS") for pid in self.process_ids()) * 1024

    def peak_rss_bytes(self) -> int:
        """The sum of the server processes' peak RSS since the last reset (0 where unknown)."""
        return sum(status_kib(pid, "VmHWM") for pid in self.process_ids()) * 1024

    def process_ids(self) -> list[int]:
        """The server's pid and its descendants' (Linux /proc; just the server elsewhere)."""
        assert self.process is not None
        pids, queue = [], [self.process.pid]
        while queue:
            pid = queue.pop()
            pids.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                with contextlib.suppress(OSError):
                    queue.extend(int(child) for child in task.read_text().split())
        return pids

    def __enter__(self) -> PeerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def status_kib(pid: int, field_name: str) -> int:
    """A field of /proc/PID/status in KiB (0 where unreadable: the process is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field_name}:"):
                return int(line.split()[1])
    return 0


def _tail(path: Path, num_bytes: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes()[-num_bytes:].decode(errors="replace")
    return ""


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
