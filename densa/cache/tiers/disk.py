"""The local disk tier: one file per block under a private directory, capped in bytes, least
recently used first out.

Pages are as confidential as the prompts they came from (layer 0's V rows name their tokens),
and a page planted in the directory would become attention input of whichever tenant's key it
sits under. So:

- The directory is this user's alone: created 0700; an existing one that group or others may
  use (any of the mode's 0077 bits), or that another user owns, is refused at start-up
  (TierSetupError, with what to do). It is opened once and every file operation is relative to
  that descriptor, so a directory renamed or swapped behind the server's back is not followed.
- Files are created 0600 with O_CREAT | O_EXCL | O_NOFOLLOW under an unpredictable temporary
  name, then renamed into place: a name planted in advance (a symbolic link, anything) makes
  the write fail, never writes through it. Reads open with O_NOFOLLOW | O_NONBLOCK and take only
  regular files: a planted link or FIFO is a miss.
- Every block carries a MAC (block.py): under the cluster's tier key where there is a cluster
  secret, else under this directory's own key, KEY_FILE (32 random bytes, 0600, made on first
  use). The key file stays with the blocks, so a restart finds both and its blocks are hits
  again; deleting it, or adding, changing or removing the cluster secret, turns every block
  written before into a miss (counted "checksum", the file deleted as it is read).

Writes go to the temporary name and are renamed into place (rename is atomic within one file
system), so a process killed mid-write (kill -9, power aside: no fsync) leaves at most a
temporary file that no read ever looks at; the next start removes those of processes that are
gone. Reads check every field (block.py); a file that fails is deleted and served as a miss. A
write that finds the disk full or the directory not writable disables the tier, with one
warning.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from densa.cache.tiers.block import MAX_BLOCK_BYTES, BlockCodec
from densa.cache.tiers.tier import TierCounters, TierSetupError, logger, verified_payload

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
KEY_FILE = ".densa-kv-key"
KEY_BYTES = 32
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO
# Errors that say the tier cannot work at all (as opposed to one failed file).
_FATAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM}


class DiskTier:
    def __init__(self, path: str, size_bytes: int, fingerprint: bytes,
                 mac_key: bytes | None = None) -> None:  # fmt: skip
        """`mac_key`: the cluster's tier key, or None for this directory's own key. Raises
        TierSetupError for a directory (or key file) others may use; any other failure to use
        the directory turns the tier off with a warning."""
        self.name = f"disk:{path}"
        self.counters = TierCounters()
        self.directory = Path(path)
        self.size_bytes = size_bytes
        self._prefix = fingerprint.hex()[:16] + "-"  # another model's files never match
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU first
        self._total_bytes = 0
        self._dir_fd = -1
        self._codec: BlockCodec | None = None  # None: the tier is off
        try:
            self._dir_fd = open_private_directory(self.directory)
            key = mac_key or directory_key(self._dir_fd, self.directory)
            self._codec = BlockCodec(fingerprint, key)
            self._scan()
            self._probe()
        except TierSetupError:
            self.close()
            raise
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
        if self._codec is None or not present:
            self.counters.count_miss()
            return None
        data = self._read(name)
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
        if self.counters.disabled or self._codec is None:
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
            self._unlink(victim)
        with self.counters._lock:
            self.counters.blocks_written += 1
            self.counters.bytes_written += len(data)

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    # ---- internals -----------------------------------------------------------------------------
    def _file_name(self, key: bytes) -> str:
        return self._prefix + key.hex() + SUFFIX

    def _scan(self) -> None:
        """Index what an earlier run left (oldest first), and drop unfinished writes of
        processes that are gone. Only regular files count: a link planted under a block's name
        is never indexed, so never read."""
        files = []
        with os.scandir(self._dir_fd) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    if _writer_is_gone(entry.name):
                        self._unlink(entry.name)
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    files.append((info.st_mtime, entry.name, info.st_size))
        for _, name, size in sorted(files):
            self._sizes[name] = size
            self._total_bytes += size
        for victim in self._over_cap():
            self._unlink(victim)

    def _probe(self) -> None:
        name = _temporary_name()
        os.close(os.open(name, _NEW_FILE, FILE_MODE, dir_fd=self._dir_fd))
        self._unlink(name)

    def _write(self, name: str, data: bytes) -> bool:
        tmp = _temporary_name()
        try:
            fd = os.open(tmp, _NEW_FILE, FILE_MODE, dir_fd=self._dir_fd)
        except OSError as exc:  # not ours (EEXIST: something planted there): leave it
            return self._write_failed(exc)
        try:
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            return True
        except OSError as exc:
            self._unlink(tmp)
            return self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> bool:
        if exc.errno in _FATAL_ERRNOS:
            self._disable(f"writing failed ({exc.strerror}); the disk tier is off")
        else:
            with self.counters._lock:
                self.counters.write_errors += 1
            self.counters.warn_once(self.name, "write", f"a write failed: {exc}")
        return False

    def _read(self, name: str) -> bytes | None:
        """The file's bytes (at most MAX_BLOCK_BYTES + 1: a larger file fails its length
        check), or None if it is gone or not a regular file (a link or FIFO planted there)."""
        try:
            fd = os.open(name, _READ_FILE, dir_fd=self._dir_fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                return read_all(fd, MAX_BLOCK_BYTES + 1)
            finally:
                os.close(fd)
        except OSError:  # removed behind our back, or never ours: a miss
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
        self._unlink(name)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(OSError):  # already gone, or the directory went read-only
            os.unlink(name, dir_fd=self._dir_fd)

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


# ---- the private directory and its key -----------------------------------------------------------
def open_private_directory(path: Path) -> int:
    """A descriptor of the tier's directory, created 0700 if missing (its parents with the
    umask); TierSetupError if another user owns it or group or others have any access."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIRECTORY_MODE)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_private(os.fstat(fd), f"--kv-tier disk:{path}: the directory",
                       f"chmod 700 {path}")  # fmt: skip
    except TierSetupError:
        os.close(fd)
        raise
    return fd


def directory_key(dir_fd: int, path: Path) -> bytes:
    """The directory's own MAC key (KEY_FILE), made on first use. Two servers starting on one
    directory at once agree: the key file appears whole (a link), and the second uses it."""
    for _ in range(3):  # a key file another process just made is read on the next turn
        with contextlib.suppress(FileNotFoundError):
            return _read_key(dir_fd, path)
        _create_key(dir_fd)
    return _read_key(dir_fd, path)


def _read_key(dir_fd: int, path: Path) -> bytes:
    shown = f"--kv-tier disk:{path}: the key file {path / KEY_FILE}"
    remedy = f"delete it (the blocks it signed become misses): rm {path / KEY_FILE}"
    try:
        fd = os.open(KEY_FILE, _READ_FILE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TierSetupError(f"{shown} is a symbolic link; {remedy}") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TierSetupError(f"{shown} is not a regular file; {remedy}")
        _check_private(info, shown, remedy)
        key = read_all(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise TierSetupError(f"{shown} holds {len(key)} bytes, not a {KEY_BYTES}-byte key; "
                             f"{remedy}")  # fmt: skip
    return key


def _create_key(dir_fd: int) -> None:
    tmp = _temporary_name()
    fd = os.open(tmp, _NEW_FILE, FILE_MODE, dir_fd=dir_fd)
    try:
        write_all(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)  # the key is durable before its name appears
    finally:
        os.close(fd)
    try:
        os.link(tmp, KEY_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        pass  # another process made it first: that one is the directory's key
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)


def _check_private(info: os.stat_result, shown: str, remedy: str) -> None:
    uid = os.geteuid()
    if info.st_uid != uid:
        raise TierSetupError(
            f"{shown} belongs to uid {info.st_uid}, not to this server's uid {uid}: its owner "
            f"could read the cached pages (as confidential as the prompts) and plant pages of "
            f"their own. Use a directory of this user's, or {remedy}"
        )
    if info.st_mode & 0o077:
        raise TierSetupError(
            f"{shown} has mode {stat.S_IMODE(info.st_mode):04o}: other users could read the "
            f"cached pages (as confidential as the prompts). Make it private: {remedy}"
        )


# ---- files ---------------------------------------------------------------------------------------
def _temporary_name() -> str:
    """A name nobody can guess ahead (a random part), and the writer's pid for the cleanup."""
    return f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def _writer_is_gone(tmp_name: str) -> bool:
    """Is the process that made this temporary file gone (so the file is a dead write)? Another
    live server on the same directory keeps its own."""
    pid_text = tmp_name[len(TMP_PREFIX) :].split("-", 1)[0]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return True  # ours from before this start (a pid reused, as in a container): dead
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_all(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes of the file, from its start."""
    chunks = []
    while limit > 0:
        chunk = os.read(fd, min(limit, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)
