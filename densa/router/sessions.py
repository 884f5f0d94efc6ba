"""Session affinity: `x-session-affinity` -> the worker its conversation lives on, with a TTL.

A session's first request is placed by the policy (the ring home is one of its signals); from
then on the session is *stuck* to that worker for `ttl_s` after its latest request, so its
growing prefix keeps hitting one cache. An entry whose worker is ejected is dropped, and the
session is placed again (its cache died with the worker anyway).

The table also counts each worker's live sessions: the load a new session will share that
worker with turn after turn (policy.py's queue signal, for new sessions).
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
        # id -> (url, expiry); in expiry order, since every stick moves its entry to the end with
        # an expiry `ttl_s` ahead, so expired entries are dropped from the front.
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._num_live: dict[str, int] = {}  # url -> live sessions stuck to it

    def __len__(self) -> int:
        self._drop_expired()
        return len(self._entries)

    def lookup(self, session_id: str) -> str | None:
        """The session's worker if its entry is live (dropping expired entries first)."""
        self._drop_expired()
        entry = self._entries.get(session_id)
        return entry[0] if entry is not None else None

    def stick(self, session_id: str, url: str) -> None:
        """The session now lives on `url`, for another TTL."""
        self._remove(session_id)
        self._entries[session_id] = (url, self._clock() + self.ttl_s)
        self._num_live[url] = self._num_live.get(url, 0) + 1
        while len(self._entries) > self.max_sessions:
            self._remove(next(iter(self._entries)))

    def num_live(self, url: str) -> int:
        """Live sessions stuck to `url`."""
        self._drop_expired()
        return self._num_live.get(url, 0)

    def forget_worker(self, url: str) -> int:
        """Drop every session stuck to `url` (ejected); returns how many."""
        gone = [sid for sid, (owner, _) in self._entries.items() if owner == url]
        for sid in gone:
            self._remove(sid)
        return len(gone)

    def _remove(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return
        left = self._num_live[entry[0]] - 1
        if left:
            self._num_live[entry[0]] = left
        else:
            del self._num_live[entry[0]]

    def _drop_expired(self) -> None:
        now = self._clock()
        while self._entries:
            session_id, (_, expiry) = next(iter(self._entries.items()))
            if expiry > now:
                return
            self._remove(session_id)
