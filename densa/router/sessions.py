"""Session affinity: `x-session-affinity` -> the worker its conversation lives on, with a TTL.

A session's first request is placed by the policy (the ring home is one of its signals); from
then on the session is *stuck* to that worker for `ttl_s` after its latest request, so its
growing prefix keeps hitting one cache. An entry whose worker is ejected is dropped, and the
session is placed again (its cache died with the worker anyway).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_TTL_S = 600.0
DEFAULT_MAX_SESSIONS = 100_000  # entries past this are dropped oldest first (bounded memory)


class SessionTable:
    """session id -> worker URL, expiring `ttl_s` after the session's last request."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (url, expiry)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, session_id: str) -> str | None:
        """The session's worker if its entry is live (no mutation but dropping an expired one)."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        url, expiry = entry
        if expiry <= self._clock():
            del self._entries[session_id]
            return None
        return url

    def stick(self, session_id: str, url: str) -> None:
        """The session now lives on `url`, for another TTL."""
        self._entries[session_id] = (url, self._clock() + self.ttl_s)
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)

    def forget_worker(self, url: str) -> int:
        """Drop every session stuck to `url` (ejected); returns how many."""
        gone = [sid for sid, (owner, _) in self._entries.items() if owner == url]
        for sid in gone:
            del self._entries[sid]
        return len(gone)
