"""What every KV tier offers, what it counts, and how `--kv-tier` names one.

A tier stores encoded blocks (block.py) by block key. `get` returns a payload only after every
check passed; any failure (absent, corrupt, unreachable) is a miss. `put` is called only from the
background writer (writer.py), never from the engine's step. A tier that cannot work (disk full,
directory not writable) disables itself with one warning; serving goes on without it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Protocol

from densa.cache.tiers.block import BlockCodec, BlockRejected
from densa.utils.sizes import parse_memory

logger = logging.getLogger("densa.kv_tiers")


@dataclass
class TierCounters:
    """Lifetime counters of one tier (read by /metrics; written by the engine and the writer)."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0  # blocks present but failing a check (also counted as misses)
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    write_errors: int = 0
    fetch_seconds: float = 0.0  # time spent in get(), hits and misses alike
    num_fetches: int = 0
    disabled: bool = False
    rejected_reasons: dict[str, int] = field(default_factory=dict)
    _logged: set[str] = field(default_factory=set)  # what has been logged once already
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "rejected": self.rejected,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "blocks_written": self.blocks_written,
                "write_errors": self.write_errors,
                "fetch_seconds": self.fetch_seconds,
                "fetches": self.num_fetches,
                "disabled": float(self.disabled),
            }

    def record_rejected(self, tier: str, error: BlockRejected) -> None:
        """Count a block that failed a check; log only the first of each reason."""
        with self._lock:
            self.rejected += 1
            self.rejected_reasons[error.reason] = self.rejected_reasons.get(error.reason, 0) + 1
            first = error.reason not in self._logged
            self._logged.add(error.reason)
        if first:
            logger.warning("KV tier %s: a block failed its check (%s); served as a miss "
                           "(further %r failures are counted, not logged)", tier, error,
                           error.reason)  # fmt: skip

    def count_miss(self) -> None:
        with self._lock:
            self.misses += 1

    def count_hit(self, num_bytes: int) -> None:
        with self._lock:
            self.hits += 1
            self.bytes_read += num_bytes

    def warn_once(self, tier: str, what: str, message: str) -> None:
        with self._lock:
            first = what not in self._logged
            self._logged.add(what)
        if first:
            logger.warning("KV tier %s: %s", tier, message)


def verified_payload(
    codec: BlockCodec, counters: TierCounters, tier: str, key: bytes, data: bytes | None
) -> memoryview | None:
    """What every tier's `get` does with the bytes it found under `key` (None: nothing): the
    payload once every check passed (a hit), else None (a miss; a block failing a check is
    counted as rejected too)."""
    if data is None:
        counters.count_miss()
        return None
    try:
        payload = codec.decode(key, data)
    except BlockRejected as error:
        counters.record_rejected(tier, error)
        counters.count_miss()
        return None
    counters.count_hit(len(data))
    return payload


class KVTier(Protocol):
    """One level below the device pool. Thread-safe: the engine reads, the writer writes."""

    name: str  # "disk:/path" or "shared:redis://host:port/db", for logs and /metrics
    counters: TierCounters

    def get(self, key: bytes) -> memoryview | None:
        """The verified payload stored under `key`, or None (a miss, counted)."""
        ...

    def contains(self, key: bytes) -> bool:
        """Might `get` hit? (cheap; no verification)"""
        ...

    def put(self, key: bytes, payload: bytes | memoryview) -> None:
        """Store a full page's payload (writer thread only). Never raises for a tier fault."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TierSpec:
    kind: str  # host | disk | shared
    path: str = ""  # disk: the directory
    size_bytes: int = 0  # host, disk: the cap
    url: str = ""  # shared: redis://HOST:PORT[/DB]


def parse_tier_spec(text: str) -> TierSpec:
    """`host:SIZE`, `disk:PATH:SIZE` (SIZE like 20GiB) or `shared:redis://HOST:PORT[/DB]`."""
    kind, _, rest = text.partition(":")
    if kind == "host":
        return TierSpec("host", size_bytes=_tier_size(text, rest, "host:SIZE (e.g. host:32GiB)"))
    if kind == "disk":
        path, _, size = rest.rpartition(":")
        if not path or not size:
            raise ValueError(
                f"--kv-tier {text!r}: expected disk:PATH:SIZE (e.g. disk:/var/kv:20GiB)"
            )
        return TierSpec("disk", path=path, size_bytes=_tier_size(text, size, "disk:PATH:SIZE"))
    if kind == "shared":
        if not rest.startswith("redis://"):
            raise ValueError(
                f"--kv-tier {text!r}: expected shared:redis://HOST:PORT[/DB] (the shared tier "
                "is a Redis server)"
            )
        return TierSpec("shared", url=rest)
    raise ValueError(f"--kv-tier {text!r}: the kind must be host, disk or shared")


def _tier_size(text: str, size: str, form: str) -> int:
    if not size:
        raise ValueError(f"--kv-tier {text!r}: expected {form}")
    try:
        size_bytes = parse_memory(size)
    except ValueError as exc:
        raise ValueError(f"--kv-tier {text!r}: {exc}") from exc
    if not isinstance(size_bytes, int):
        raise ValueError(f"--kv-tier {text!r}: the size needs a unit (e.g. 20GiB)")
    return size_bytes
