"""A fixed set of daemon threads running submitted calls, each answered through a Future.

Why not `ThreadPoolExecutor`: Python joins its worker threads when the interpreter exits, even
after `shutdown(wait=False)`, so one call stuck for good (a read from a hung network file
system) keeps the whole process from exiting. Daemon threads do not.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_STOP = object()


class DaemonPool:
    def __init__(self, num_threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._busy = 0  # calls running now
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_idle(self) -> int:
        """Threads free to start a call now (a call stuck in a tier holds its thread)."""
        with self._lock:
            return len(self._threads) - self._busy

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """No new call starts; queued ones are cancelled. Running ones finish on their own."""
        for _ in self._threads:
            self._jobs.put(_STOP)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            with self._lock:
                self._busy += 1
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the caller reads it from the future
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._busy -= 1
        self._cancel_queued()

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job[0].cancel()
