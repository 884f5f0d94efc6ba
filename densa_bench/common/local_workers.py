"""Real densa workers on this machine for the router's tests and benchmark: `densa serve`
processes (front + engine process each) on free loopback ports, one compute thread each, started
in parallel and stopped (or killed) with their process group. Torch-free here: the workers load
the model, not this process."""

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

REPO = Path(__file__).resolve().parents[2]  # the workers import this densa tree


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


@dataclass(frozen=True)
class WorkerSettings:
    model: str | None = None  # None: the bundled default model
    served_model_name: str = "tiny"
    kv_cache_memory: str = "64MiB"
    max_model_len: int = 512
    extra_args: tuple[str, ...] = ()

    def args(self) -> list[str]:
        model = ["--model", self.model] if self.model else []
        return [*model, "--served-model-name", self.served_model_name,
                "--kv-cache-memory", self.kv_cache_memory,
                "--max-model-len", str(self.max_model_len), *self.extra_args]  # fmt: skip


def start_worker(settings: WorkerSettings, log: Path) -> WorkerProcess:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
    command = [sys.executable, "-m", "densa.cli", "--log-level", "WARNING", "serve",
               "--port", str(port), *settings.args()]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)  # fmt: skip
    return WorkerProcess(f"http://127.0.0.1:{port}", process, log)


def wait_healthy(workers: list[WorkerProcess], timeout: float = 300.0) -> None:
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
def running_workers(
    settings: WorkerSettings, n: int, log_dir: Path
) -> Iterator[list[WorkerProcess]]:
    workers = [start_worker(settings, log_dir / f"worker-{i}.log") for i in range(n)]
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
