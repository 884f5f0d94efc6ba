"""The background writer: pages go down to the tiers off the engine's thread.

The engine hands over a job (a closure that yields (key, payload) pairs from bytes it already
copied out of the device pages) and returns at once. The queue is bounded: when the tiers cannot
keep up, a job is dropped (counted) rather than the step waiting: a lost write costs a future
hit, never latency.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence

from densa.cache.tiers.tier import KVTier, logger

WriteJob = Callable[[], Iterable[tuple[bytes, memoryview]]]
MAX_QUEUED_JOBS = 64


class TierWriter:
    def __init__(self, tiers: Sequence[KVTier], max_queued: int = MAX_QUEUED_JOBS) -> None:
        self.tiers = list(tiers)
        self.num_dropped_jobs = 0
        self._jobs: queue.Queue[WriteJob | None] = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._run, name="densa-kv-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> bool:
        """Queue a job; False (dropped, counted) if the queue is full. Never blocks."""
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            self.num_dropped_jobs += 1
            return False

    def flush(self) -> None:
        """Wait until every job queued so far is written (tests, shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                for key, payload in job():
                    for tier in self.tiers:
                        tier.put(key, payload)
            except Exception:  # a bug in one job must not stop write-back for good
                logger.exception("KV tier write-back job failed; its pages were not stored")
            finally:
                self._jobs.task_done()
