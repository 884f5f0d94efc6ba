"""One densa process (a worker's `densa serve` or the `densa router`), kept alive.

A SupervisedProcess starts its command on a port of this machine, and a watcher thread starts it
again whenever it exits, after the restart policy's backoff (1 s, 2 s, 4 s ... 30 s; the count
starts over once a life lasted RESET_AFTER_S). It keeps its port across lives when the port is
still free, so the router sees the same URL ejected and re-admitted; if something else took the
port, the next life gets a new one and the cluster tells the router the URL changed.

The child is in its own process group (a stop takes its engine process too) and is told by the
kernel to die with its parent (PR_SET_PDEATHSIG, Linux), so a Ray actor killed with SIGKILL leaves
no orphan server holding a port or a GPU.

The cluster secret reaches the child in its environment ($DENSA_CLUSTER_SECRET), never on its
command line (which `ps` shows every user) and never in the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from densa.auth.secret import SECRET_ENV, ClusterSecret
from densa.cluster.config import RestartPolicy
from densa.utils.logging import get_logger
from densa.utils.private_files import open_private_log, private_dir, user_temp_dir

logger = get_logger(__name__)
RESET_AFTER_S = 60.0  # a life this long means the last crash is forgotten
_WATCH_INTERVAL_S = 0.2
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # e.g. "chat-0"; names the log file
    # argv after `python -m densa.cli`; "{host}" and "{port}" are filled in per life
    argv: tuple[str, ...]
    host: str
    port: int | None = None  # None: a free port; else exactly this one (the router's)
    env: tuple[tuple[str, str], ...] = ()
    log_dir: str = field(default_factory=lambda: str(default_log_dir()))  # this user's alone
    secret: ClusterSecret | None = field(default=None, repr=False)  # into the child's env


@dataclass(frozen=True)
class ProcessStatus:
    name: str
    url: str
    pid: int | None
    generation: int  # lives started so far (1 for the first)
    alive: bool
    last_exit_code: int | None


def default_log_dir() -> Path:
    """Where `densa cluster up` writes logs (and a new cluster secret) by default: a directory
    of this user's under the system's temporary one, on each node (utils/private_files.py)."""
    return user_temp_dir("densa-cluster")


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class SupervisedProcess:
    def __init__(
        self, spec: ProcessSpec, restart: RestartPolicy, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.spec = spec
        self.restart = restart
        self.clock = clock
        self.port = spec.port if spec.port is not None else free_port(spec.host)
        self.generation = 0
        self.num_quick_restarts = 0
        self.last_exit_code: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._restart_at: float | None = None
        self._stopping = threading.Event()
        self._first_life = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{spec.name}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def start(self) -> None:
        """Start the first life (from the watcher thread: PR_SET_PDEATHSIG follows the thread
        that forked, so every life is forked by the one thread that lives as long as we do)."""
        private_dir(self.spec.log_dir)  # refused here, loudly, not in the watcher thread
        self._restart_at = self.clock()
        self._watcher.start()
        self._first_life.wait(30)

    def status(self) -> ProcessStatus:
        with self._lock:
            process = self._process
            alive = process is not None and process.poll() is None
            return ProcessStatus(self.spec.name, self.url, process.pid if process else None,
                                 self.generation, alive, self.last_exit_code)  # fmt: skip

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group (a densa server drains), SIGKILL what is left at `timeout`."""
        self._stopping.set()
        with self._lock:
            process = self._process
        if process is None or process.poll() is not None:
            return
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(10)

    # ---- lives ----------------------------------------------------------------------------------
    def _launch(self) -> None:
        if self.generation and not port_is_free(self.spec.host, self.port):
            old, self.port = self.port, free_port(self.spec.host)
            logger.warning("%s: port %d is taken; the next life listens on %d",
                           self.spec.name, old, self.port)  # fmt: skip
        self.generation += 1
        argv = [a.format(host=self.spec.host, port=self.port) for a in self.spec.argv]
        # A private directory and no symlink followed: logs hold what a server said about its
        # requests, and another local user must not read them or point them elsewhere.
        log = private_dir(self.spec.log_dir) / f"{self.spec.name}.log"
        env = {**os.environ, **dict(self.spec.env)}
        if self.spec.secret is not None:
            env[SECRET_ENV] = self.spec.secret.value.decode()
        with os.fdopen(open_private_log(log), "ab") as out:
            out.write(f"--- life {self.generation}: {' '.join(argv)}\n".encode())
            out.flush()
            self._process = subprocess.Popen(
                [sys.executable, "-m", "densa.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
        self._started_at = self.clock()
        self._first_life.set()
        logger.info("%s: life %d, pid %d, %s", self.spec.name, self.generation,
                    self._process.pid, self.url)  # fmt: skip

    def _watch(self) -> None:
        while True:
            with self._lock:
                self._check()
            if self._stopping.wait(_WATCH_INTERVAL_S):
                return

    def _check(self) -> None:
        if self._stopping.is_set():
            return
        process = self._process
        if self._restart_at is not None:
            if self.clock() >= self._restart_at:
                self._restart_at = None
                self._launch()
            return
        if process is None or process.poll() is None:
            return
        self.last_exit_code = process.returncode
        lived = self.clock() - self._started_at
        self.num_quick_restarts = 1 if lived >= RESET_AFTER_S else self.num_quick_restarts + 1
        delay = self.restart.delay(self.num_quick_restarts)
        logger.warning("%s: exited with %s after %.1f s; restarting in %.1f s", self.spec.name,
                       process.returncode, lived, delay)  # fmt: skip
        self._restart_at = self.clock() + delay


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
