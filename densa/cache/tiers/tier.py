"""What every KV tier offers, what it counts, and how `--kv-tier` names one.

A tier stores encoded blocks (block.py) by block key. `get` returns a payload only after every
check passed; any failure (absent, corrupt, forged, unreachable, too slow) is a miss. `put` is
called only from the background writer (writer.py), never from the engine's step. A tier that
cannot work (disk full, directory not writable) disables itself with one warning; serving goes
on without it. A tier that would be unsafe to use (a directory others can read or write) is
refused at start-up instead (TierSetupError).

Names and messages never carry a secret: a tier's name is its kind and, for the shared tier, the
store's scheme and host only (labels of /metrics, log lines); `redact` takes credentials out of
any `--kv-tier` text before it is quoted in an error.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Protocol
from urllib.parse import unquote, urlsplit

from densa.cache.tiers.block import REJECT_REASONS, BlockCodec, BlockRejected
from densa.utils.sizes import parse_memory

logger = logging.getLogger("densa.kv_tiers")
DEFAULT_STORE_PORT = 6379
REJECT_LOG_EVERY_S = 60.0  # a reason is logged at most this often per tier (the rest counted)
# Greedy up to the last "@": a password with a raw "/" or "@" in it is hidden whole.
_USERINFO = re.compile(r"(?<=://)\S*@")


class TierSetupError(ValueError):
    """A tier that must not be used as configured (the message says why and what to do)."""


def redact(text: str) -> str:
    """`text` with the user and password of any URL in it replaced by `***`."""
    return _USERINFO.sub("***@", text)


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
    timeouts: int = 0  # calls cut off at their deadline (the shared tier's store)
    fetch_seconds: float = 0.0  # time spent in get(), hits and misses alike
    num_fetches: int = 0
    disabled: bool = False
    rejected_reasons: dict[str, int] = field(default_factory=dict)
    _logged: set[str] = field(default_factory=set)  # what has been logged once already
    # Rate-limited logging of rejections: reason -> (when last logged, how many since).
    _reject_log: dict[str, tuple[float, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            counters = {
                "hits": self.hits,
                "misses": self.misses,
                "rejected": self.rejected,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "blocks_written": self.blocks_written,
                "write_errors": self.write_errors,
                "timeouts": self.timeouts,
                "fetch_seconds": self.fetch_seconds,
                "fetches": self.num_fetches,
                "disabled": float(self.disabled),
            }
            for reason in REJECT_REASONS:  # every reason, zeros included: a fixed set of names
                counters[f"rejected_{reason}"] = self.rejected_reasons.get(reason, 0)
            return counters

    def record_rejected(self, tier: str, error: BlockRejected) -> None:
        """Count a block that failed a check and log it with its reason: the first of each
        reason at once, then at most one line per REJECT_LOG_EVERY_S with the count since (a
        store full of forgeries must not flood the log)."""
        now = time.monotonic()
        with self._lock:
            self.rejected += 1
            self.rejected_reasons[error.reason] = self.rejected_reasons.get(error.reason, 0) + 1
            last, unlogged = self._reject_log.get(error.reason, (-REJECT_LOG_EVERY_S, 0))
            due = now - last >= REJECT_LOG_EVERY_S
            self._reject_log[error.reason] = (now, 0) if due else (last, unlogged + 1)
        if due:
            also = f" ({unlogged} more since the last such line)" if unlogged else ""
            logger.warning("KV tier %s: a block failed its check, reason %s (%s); served as a "
                           "miss%s", tier, error.reason, error, also)  # fmt: skip

    def count_timeout(self) -> None:
        with self._lock:
            self.timeouts += 1

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

    name: str  # "host", "disk:/path" or "shared:redis://host:port" (no secret), logs and /metrics
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
class StoreAddress:
    host: str
    port: int = DEFAULT_STORE_PORT
    db: int = 0
    username: str = ""
    password: str = field(default="", repr=False)

    @property
    def location(self) -> str:
        """The scheme and host: what names the store in labels, logs and errors."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}"

    def with_password(self, password: str) -> StoreAddress:
        """This address with `password` (from a file or the environment), which the URL must
        not carry as well."""
        if not password:
            return self
        if self.password:
            raise ValueError(
                f"--kv-tier shared:{self.location}: the store's password is given twice (in the "
                "URL and in --kv-tier-password-file or DENSA_KV_TIER_PASSWORD): keep one"
            )
        return replace(self, password=password)

    @classmethod
    def parse(cls, url: str) -> StoreAddress:
        """`redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`."""
        shown = redact(url)
        try:
            parts = urlsplit(url)
            port = parts.port or DEFAULT_STORE_PORT
        except ValueError:  # not quoted: a password with a raw "/" in it ends up here
            raise ValueError(f"--kv-tier shared:{shown}: the port is not a number") from None
        if parts.scheme != "redis" or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(
                f"--kv-tier shared:{shown}: expected redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]"
            )
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"--kv-tier shared:{shown}: the database is a number (/0, /1...)")
        return cls(parts.hostname, port, int(db), unquote(parts.username or ""),
                   unquote(parts.password or ""))  # fmt: skip


@dataclass(frozen=True)
class TierSpec:
    kind: str  # host | disk | shared
    path: str = ""  # disk: the directory
    size_bytes: int = 0  # host, disk: the cap
    store: StoreAddress | None = None  # shared: the Redis server


def parse_tier_spec(text: str) -> TierSpec:
    """`host:SIZE`, `disk:PATH:SIZE` (SIZE like 20GiB) or `shared:redis://HOST:PORT[/DB]`."""
    kind, _, rest = text.partition(":")
    shown = redact(text)  # what error messages quote
    if kind == "host":
        return TierSpec("host", size_bytes=_tier_size(shown, rest, "host:SIZE (e.g. host:32GiB)"))
    if kind == "disk":
        path, _, size = rest.rpartition(":")
        if not path or not size:
            raise ValueError(
                f"--kv-tier {shown!r}: expected disk:PATH:SIZE (e.g. disk:/var/kv:20GiB)"
            )
        return TierSpec("disk", path=path, size_bytes=_tier_size(shown, size, "disk:PATH:SIZE"))
    if kind == "shared":
        if not rest.startswith("redis://"):
            raise ValueError(
                f"--kv-tier {shown!r}: expected shared:redis://HOST:PORT[/DB] (the shared tier "
                "is a Redis server)"
            )
        return TierSpec("shared", store=StoreAddress.parse(rest))
    raise ValueError(f"--kv-tier {shown!r}: the kind must be host, disk or shared")


def _tier_size(shown: str, size: str, form: str) -> int:
    if not size:
        raise ValueError(f"--kv-tier {shown!r}: expected {form}")
    try:
        size_bytes = parse_memory(size)
    except ValueError as exc:
        raise ValueError(f"--kv-tier {shown!r}: {exc}") from exc
    if not isinstance(size_bytes, int):
        raise ValueError(f"--kv-tier {shown!r}: the size needs a unit (e.g. 20GiB)")
    return size_bytes
