"""The shared tier: a Redis server every worker of a cluster reaches.

Why Redis: a well-kept server Debian ships (redis-server 7.0), one round trip per block
(GET/SET of a binary value), and its own memory cap with LRU eviction (`maxmemory` +
`maxmemory-policy allkeys-lru`), so the store never grows past what it was given. Its limits,
stated: values live in the server's memory (a page of the 1.5B model is ~230 KB, so 10 GB holds
~45k pages); a restart without persistence empties it (a cache: only hits are lost); one server
is one machine's network bandwidth. Redis authenticates nothing we can rely on inside the
cluster (its password, if set, only keeps strangers off the store), so every value carries a MAC
under the cluster secret (block.py): a value written without the secret, altered in the store,
or moved to another key (another block's or another tenant's) is a miss.

Faults cost nothing but hits: every call has a hard deadline from connect to the last byte of
the answer (resp.py); after a failure the tier is skipped (no call at all) for RETRY_AFTER_S,
then tried again. The tier's name, in /metrics and logs, is the store's scheme and host only:
never its password or database.
"""

from __future__ import annotations

import hashlib
import threading
import time

from densa.cache.tiers.block import MAX_BLOCK_BYTES, BlockCodec
from densa.cache.tiers.resp import RespClient, StoreError, StoreTimeout
from densa.cache.tiers.tier import StoreAddress, TierCounters, verified_payload

KEY_PREFIX = b"densa:kv:"
# The whole call: connect, AUTH, the command and its whole answer. A GET of one page takes well
# under a millisecond on a LAN; a store that needs longer costs the asking request its hits.
CALL_TIMEOUT_S = 0.25
RETRY_AFTER_S = 1.0


class SharedTier:
    def __init__(self, address: StoreAddress, fingerprint: bytes, mac_key: bytes,
                 timeout_s: float | None = None) -> None:  # fmt: skip
        """`timeout_s`: the deadline of each call (default CALL_TIMEOUT_S)."""
        self.name = f"shared:{address.location}"
        self.counters = TierCounters()
        self._codec = BlockCodec(fingerprint, mac_key)
        self._store = f"{address.location}/{address.db}"  # the store's identity, no secret
        self._prefix = KEY_PREFIX + fingerprint.hex()[:16].encode() + b":"
        timeout_s = CALL_TIMEOUT_S if timeout_s is None else timeout_s
        self._client = RespClient(address, timeout_s, MAX_BLOCK_BYTES)  # connects on first use
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def store_id(self) -> str:
        """Names this store and this engine's pages in it, for routers: equal on every worker
        of the cluster that reads the same store (and database) with the same model and format,
        and keyed with the cluster's tier key, so it tells nobody else the store's address."""
        digest = hashlib.blake2b(self._store.encode() + self._codec.fingerprint, digest_size=8,
                                 key=self._codec.mac_key)  # fmt: skip
        return digest.hexdigest()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def contains(self, key: bytes) -> bool:
        if self.is_down:
            return False
        try:
            return self._client.exists(self._prefix + key)
        except StoreError as exc:
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
        except StoreError as exc:
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
            return self._client.get(self._prefix + key)
        except StoreError as exc:
            self._went_down(exc)
            return None

    def _went_down(self, exc: StoreError) -> None:
        if isinstance(exc, StoreTimeout):
            self.counters.count_timeout()
        with self._lock:
            self._down_until = time.monotonic() + RETRY_AFTER_S
        self.counters.warn_once(
            self.name,
            "down",
            f"unreachable or too slow ({exc}); skipped for {RETRY_AFTER_S:.0f} s at a time "
            "until it answers (further outages are counted in write_errors and timeouts, not "
            "logged)",
        )
