"""What the scheduler did on its own, reported to the engine as typed events.

Most request endings are the engine's decision (abort, integrity violation, sampling error) or
visible in the step's results (a stop token, a length limit). These are the rest: things the
scheduler decided while scheduling or bookkeeping, which the engine must report or count.
"""

from __future__ import annotations

from dataclasses import dataclass

from densa.cache.integrity import IntegrityViolation
from densa.request import RequestStatus


@dataclass(frozen=True)
class RequestEnded:
    """The scheduler ended a request itself: it outgrew the whole KV cache, or its own
    bookkeeping raised (confined to it). Its pages are already free."""

    request_id: str
    status: RequestStatus
    error: str | None


@dataclass(frozen=True)
class ReleaseViolation:
    """Freeing a request's pages found one that was no longer its own (counted, not fatal)."""

    violation: IntegrityViolation


SchedulerEvent = RequestEnded | ReleaseViolation
