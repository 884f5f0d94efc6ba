"""The local disk tier: one file per block under a directory, capped in bytes, least recently
used first out.

Writes go to a hidden temporary name and are renamed into place (rename is atomic within one
file system), so a process killed mid-write (kill -9, power aside: no fsync) leaves at most a
temporary file that no read ever looks at; the next start removes it. Reads check every field
(block.py); a file that fails is deleted and served as a miss. A write that finds the disk full
or the directory not writable disables the tier, with one warning.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
from collections import OrderedDict
from pathlib import Path

from densa.cache.tiers.block import BlockCodec
from densa.cache.tiers.tier import TierCounters, logger, verified_payload

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
# Errors that say the tier cannot work at all (as opposed to one failed file).
_FATAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM}


class DiskTier:
    def __init__(self, path: str, size_bytes: int, codec: BlockCodec) -> None:
        self.name = f"disk:{path}"
        self.counters = TierCounters()
        self.directory = Path(path)
        self.size_bytes = size_bytes
        self._codec = codec
        self._prefix = codec.fingerprint.hex()[:16] + "-"  # another model's files never match
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU first
        self._total_bytes = 0
        self._tmp_ids = itertools.count()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._probe()
        except OSError as exc:
            self._disable(f"cannot use {path} ({exc.strerror or exc}); the disk tier is off")

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._file_name(key) in self._sizes

    def get(self, key: bytes) -> memoryview | None:
        name = self._file_name(key)
        with self._lock:
            present = name in self._sizes and not self.counters.disabled
        data = self._read(name) if present else None
        payload = verified_payload(self._codec, self.counters, self.name, key, data)
        if payload is None:
            if data is not None:  # present but failing a check: never read again
                self._remove(name)
            return None
        with self._lock:
            if name in self._sizes:
                self._sizes.move_to_end(name)
        return payload

    def put(self, key: bytes, payload: bytes | memoryview) -> None:
        if self.counters.disabled:
            return
        name = self._file_name(key)
        with self._lock:
            if name in self._sizes:
                self._sizes.move_to_end(name)
                return
        data = self._codec.encode(key, payload)
        if not self._write(name, data):
            return
        with self._lock:
            if name not in self._sizes:
                self._sizes[name] = len(data)
                self._total_bytes += len(data)
            victims = self._over_cap()
        for victim in victims:
            _unlink(self.directory / victim)
        with self.counters._lock:
            self.counters.blocks_written += 1
            self.counters.bytes_written += len(data)

    def close(self) -> None:
        pass

    # ---- internals -----------------------------------------------------------------------------
    def _file_name(self, key: bytes) -> str:
        return self._prefix + key.hex() + SUFFIX

    def _scan(self) -> None:
        """Index what an earlier run left (oldest first), and drop its unfinished writes."""
        files = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith(TMP_PREFIX):
                _unlink(Path(entry.path))
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                stat = entry.stat()
                files.append((stat.st_mtime, entry.name, stat.st_size))
        for _, name, size in sorted(files):
            self._sizes[name] = size
            self._total_bytes += size
        for victim in self._over_cap():
            _unlink(self.directory / victim)

    def _probe(self) -> None:
        probe = self.directory / f"{TMP_PREFIX}probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()

    def _write(self, name: str, data: bytes) -> bool:
        tmp = self.directory / f"{TMP_PREFIX}{os.getpid()}-{next(self._tmp_ids)}"
        try:
            with open(tmp, "wb") as out:
                out.write(data)
            os.replace(tmp, self.directory / name)
            return True
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in _FATAL_ERRNOS:
                self._disable(f"writing failed ({exc.strerror}); the disk tier is off")
            else:
                with self.counters._lock:
                    self.counters.write_errors += 1
                self.counters.warn_once(self.name, "write", f"a write failed: {exc}")
            return False

    def _read(self, name: str) -> bytes | None:
        try:
            return (self.directory / name).read_bytes()
        except OSError:  # removed behind our back: a miss
            with self._lock:
                size = self._sizes.pop(name, None)
                if size is not None:
                    self._total_bytes -= size
            return None

    def _remove(self, name: str) -> None:
        with self._lock:
            size = self._sizes.pop(name, None)
            if size is not None:
                self._total_bytes -= size
        _unlink(self.directory / name)

    def _over_cap(self) -> list[str]:
        """Pop least recently used files until the total fits the cap (caller holds the lock)."""
        victims = []
        while self._total_bytes > self.size_bytes and self._sizes:
            name, size = self._sizes.popitem(last=False)
            self._total_bytes -= size
            victims.append(name)
        return victims

    def _disable(self, message: str) -> None:
        self.counters.disabled = True
        logger.warning("KV tier %s: %s; serving continues without it", self.name, message)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):  # already gone, or the directory went read-only
        path.unlink()
