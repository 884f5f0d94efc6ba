"""The shared tier: a Redis server every worker of a cluster reaches.

Why Redis: a well-kept server Debian ships (redis-server 7.0), one round trip per block
(GET/SET of a binary value), and its own memory cap with LRU eviction (`maxmemory` +
`maxmemory-policy allkeys-lru`), so the store never grows past what it was given. Its limits,
stated: values live in the server's memory (a page of the 1.5B model is ~230 KB, so 10 GB holds
~45k pages); a restart without persistence empties it (a cache: only hits are lost); one server
is one machine's network bandwidth. Redis authenticates nothing we can rely on inside the
cluster, so every value carries a MAC under the cluster secret (block.py): a value written
without the secret, or altered in the store, is a miss.

Faults cost nothing but hits: every call has a short timeout; after a failure the tier is
skipped (no call at all) for RETRY_AFTER_S, then tried again.
"""

from __future__ import annotations

import hashlib
import threading
import time

import redis

from densa.cache.tiers.block import BlockCodec
from densa.cache.tiers.tier import TierCounters, verified_payload

KEY_PREFIX = b"densa:kv:"
SOCKET_TIMEOUT_S = 0.25  # a GET of one page takes well under a millisecond on a LAN
RETRY_AFTER_S = 1.0


class SharedTier:
    def __init__(self, url: str, codec: BlockCodec, timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        self.name = f"shared:{url}"
        self.counters = TierCounters()
        self._codec = codec
        self._prefix = KEY_PREFIX + codec.fingerprint.hex()[:16].encode() + b":"
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def store_id(self) -> str:
        """Names this store and this engine's pages in it, for routers: equal on every worker
        of the cluster that reads the same URL with the same model and format, and keyed with
        the cluster secret, so it tells nobody else the store's address."""
        digest = hashlib.blake2b(self.name.encode() + self._codec.fingerprint, digest_size=8,
                                 key=self._codec.mac_key)  # fmt: skip
        return digest.hexdigest()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def contains(self, key: bytes) -> bool:
        if self.is_down:
            return False
        try:
            return bool(self._client.exists(self._prefix + key))
        except redis.RedisError as exc:
            self._went_down(exc)
            return False

    def get(self, key: bytes) -> memoryview | None:
        return verified_payload(self._codec, self.counters, self.name, key, self._fetch(key))

    def put(self, key: bytes, payload: bytes | memoryview) -> None:
        if self.is_down:
            return
        data = self._codec.encode(key, payload)
        try:
            self._client.set(self._prefix + key, data)
        except redis.RedisError as exc:
            with self.counters._lock:
                self.counters.write_errors += 1
            self._went_down(exc)
            return
        with self.counters._lock:
            self.counters.blocks_written += 1
            self.counters.bytes_written += len(data)

    def close(self) -> None:
        self._client.close()

    def _fetch(self, key: bytes) -> bytes | None:
        if self.is_down:
            return None
        try:
            value = self._client.get(self._prefix + key)
        except redis.RedisError as exc:
            self._went_down(exc)
            return None
        return value if isinstance(value, bytes) else None

    def _went_down(self, exc: Exception) -> None:
        with self._lock:
            self._down_until = time.monotonic() + RETRY_AFTER_S
        self.counters.warn_once(
            self.name,
            "down",
            f"unreachable ({exc}); skipped for {RETRY_AFTER_S:.0f} s at a "
            "time until it answers (further outages are counted in write_errors, not logged)",
        )
