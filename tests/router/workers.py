"""Real densa workers for the router tests: `densa serve` processes (front + engine process) on
free loopback ports, one thread each, started in parallel and killed with their process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class WorkerProcess:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def kill_9(self) -> None:
        """SIGKILL the front and its engine process at once (a machine losing power)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def start_worker(model_dir: Path, log: Path, extra: tuple[str, ...] = ()) -> WorkerProcess:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
    command = [sys.executable, "-m", "densa.cli", "--log-level", "WARNING", "serve",
               "--model", str(model_dir), "--served-model-name", "tiny",
               "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--port", str(port),
               *extra]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)  # fmt: skip
    return WorkerProcess(f"http://127.0.0.1:{port}", process, log)


def wait_healthy(workers: list[WorkerProcess], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        worker = pending[0]
        if worker.process.poll() is not None:
            raise RuntimeError(f"worker exited: {worker.log.read_text()[-3000:]}")
        try:
            if httpx.get(worker.url + "/health", timeout=1).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"worker not healthy in {timeout} s: {worker.log.read_text()[-3000:]}"
            )
        time.sleep(0.1)


@contextlib.contextmanager
def running_workers(model_dir: Path, n: int, log_dir: Path) -> Iterator[list[WorkerProcess]]:
    workers = [start_worker(model_dir, log_dir / f"worker-{i}.log") for i in range(n)]
    try:
        wait_healthy(workers)
        yield workers
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.process.pid, signal.SIGTERM)
        for worker in workers:
            try:
                worker.process.wait(15)
            except subprocess.TimeoutExpired:
                worker.kill_9()
