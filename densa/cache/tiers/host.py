"""The host tier: blocks kept in this process's memory, below a GPU's device pool
(`--kv-tier host:SIZE`, first in tier order).

On a GPU the device pool is the accelerator's memory and host RAM is several times larger: a
prefix page evicted from the device comes back from here with one copy over the bus instead of
a prefill. On a CPU the device pool is host memory already, so a host tier holds what a larger
--kv-cache-memory would hold, through an extra copy; it works there (and is tested there), but
a larger pool is the better use of the same bytes.

Blocks are kept encoded (block.py: key, fingerprint, MAC) and checked on every read like any
tier's: memory written by this process is not trusted more than a file, since a stray write
would otherwise become attention input. The MAC key is the cluster's tier key where there is a
cluster secret, else one drawn at random for this process (the tier is empty at every start
anyway). Capped in bytes, least recently used first out (reads refresh). Thread-safe: the
reader threads get, the writer thread puts.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

from densa.cache.tiers.block import BlockCodec
from densa.cache.tiers.tier import TierCounters, verified_payload

PROCESS_KEY_BYTES = 32


class HostTier:
    def __init__(self, size_bytes: int, fingerprint: bytes, mac_key: bytes | None = None) -> None:
        self.name = "host"
        self.counters = TierCounters()
        self.size_bytes = size_bytes
        self._codec = BlockCodec(fingerprint, mac_key or secrets.token_bytes(PROCESS_KEY_BYTES))
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # key -> encoded block, LRU first
        self._total_bytes = 0

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def get(self, key: bytes) -> memoryview | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
        return verified_payload(self._codec, self.counters, self.name, key, data)

    def put(self, key: bytes, payload: bytes | memoryview) -> None:
        data = self._codec.encode(key, payload)
        if len(data) > self.size_bytes:
            self.counters.warn_once(self.name, "too-small", "a block is larger than the tier")
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            self._total_bytes -= len(old) if old is not None else 0
            self._blocks[key] = data
            self._total_bytes += len(data)
            while self._total_bytes > self.size_bytes:
                _, dropped = self._blocks.popitem(last=False)
                self._total_bytes -= len(dropped)
        with self.counters._lock:
            self.counters.blocks_written += 1
            self.counters.bytes_written += len(data)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._total_bytes = 0
