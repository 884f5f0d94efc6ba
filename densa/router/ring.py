"""A consistent-hash ring: where a session lives when nothing else says.

Each worker owns `num_vnodes` points on a 64-bit circle (hashes of "url#i"); a key belongs to the
first point clockwise from its own hash. Adding a worker takes over only the arcs its points land
on -- about 1/N of the keys, all of them moving *to* the new worker -- and removing one hands only
its own keys to the others. Many virtual nodes per worker keep the arcs even (with 1 point each,
one worker could own half the circle).

    points:  0 ------ a1 ---- b1 ----- a2 --- c1 ------- b2 ----- 2^64
    key k:               ^k  -> the next point is b1: worker b
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

DEFAULT_VNODES = 64


def _point(text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=b"densa-ring")
    return int.from_bytes(digest.digest(), "big")


class HashRing:
    """Keys -> members (worker URLs). Mutated only by add / remove; lookups are O(log points)."""

    def __init__(self, members: Iterable[str] = (), num_vnodes: int = DEFAULT_VNODES) -> None:
        if num_vnodes < 1:
            raise ValueError("a ring needs at least one virtual node per member")
        self.num_vnodes = num_vnodes
        self._points: list[int] = []  # sorted
        self._owner: dict[int, str] = {}  # point -> member
        self._members: set[str] = set()
        for member in members:
            self.add(member)

    def __contains__(self, member: str) -> bool:
        return member in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, member: str) -> None:
        if member in self._members:
            return
        self._members.add(member)
        for i in range(self.num_vnodes):
            point = _point(f"{member}#{i}")
            if point in self._owner:  # a 64-bit collision: the first owner keeps the point
                continue
            self._owner[point] = member
            bisect.insort(self._points, point)

    def remove(self, member: str) -> None:
        if member not in self._members:
            return
        self._members.discard(member)
        self._points = [p for p in self._points if self._owner[p] != member]
        self._owner = {p: m for p, m in self._owner.items() if m != member}

    def owner(self, key: str, allowed: frozenset[str] | set[str] | None = None) -> str | None:
        """The member owning `key`; with `allowed`, the first allowed member clockwise (so an
        ejected worker's keys spread over the others as if it had been removed). None if no
        member qualifies."""
        if not self._points:
            return None
        start = bisect.bisect_right(self._points, _point(key))
        for i in range(len(self._points)):
            member = self._owner[self._points[(start + i) % len(self._points)]]
            if allowed is None or member in allowed:
                return member
        return None
