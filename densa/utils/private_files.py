"""Directories only this user can change, and files created in them without following links.

A fixed name under /tmp is a trap on a shared host: another local user can create it first (a
directory of theirs, or a symlink to one) and then read, replace or redirect whatever is written
inside: a cluster secret written there is theirs, and with it membership of the internal plane.
So a directory densa writes secrets or logs into is created 0700, and an existing one is used
only if it is a real directory (not a symlink), belongs to this user and nobody else can write
to it. Files are opened with O_NOFOLLOW (a planted symlink is an error, never followed) and, for
secrets, O_EXCL (never an existing file), their mode set on the descriptor.

Only the last component of a directory is checked: its parents are the operator's choice (the
defaults live right under the system's temporary directory, which the sticky bit protects).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

_NOT_OURS = stat.S_IWGRP | stat.S_IWOTH  # bits that let someone else add, remove or swap entries


class PrivateDirError(OSError):
    """A directory that is not this user's alone (the message says why and what to do)."""


def private_dir(path: str | Path) -> Path:
    """`path`, created 0700 if missing; PrivateDirError if it is a symlink, not a directory,
    another user's, or writable by group or others."""
    path = Path(path)
    created = _make_dir(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file stands there
        raise PrivateDirError(f"{path} is not a directory of its own (a symlink or a file): "
                              "remove it or choose another directory") from exc  # fmt: skip
    try:
        if created:
            os.fchmod(fd, 0o700)  # the umask may have kept bits mkdir's mode did not give
        _check_owned(path, os.fstat(fd))
    finally:
        os.close(fd)
    return path


def user_temp_dir(name: str) -> Path:
    """A per-user default under the system's temporary directory: `<tmp>/<name>-<uid>`.
    Another user may still create it first; private_dir then refuses it rather than use it."""
    return Path(tempfile.gettempdir()) / f"{name}-{os.geteuid()}"


def create_private_file(path: str | Path, data: bytes) -> None:
    """Write `data` to a new file at `path`, mode 0600: FileExistsError if anything (a file, a
    symlink) is already there, so nothing is overwritten and no link is followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


def open_private_log(path: str | Path) -> int:
    """A descriptor appending to `path` (created 0600), never through a symlink (ELOOP). A log
    already there (an older densa wrote its logs 0644) is made 0600 too, through the
    descriptor; one another user owns is refused (PermissionError)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise PermissionError(f"{path} belongs to another user: refusing to write logs to it")
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dir(path: Path) -> bool:
    """Create `path` 0700 (parents with the default mode); whether this call created it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    return True


def _check_owned(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise PrivateDirError(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            "whoever made it could read or replace what is written there; remove it or choose "
            "another directory"
        )
    if st.st_mode & _NOT_OURS:
        raise PrivateDirError(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
            f"`chmod go-w {path}` or choose another directory"
        )
