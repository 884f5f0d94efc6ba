"""The disk tier keeps its pages private: the directory is made 0700 and files 0600 whatever
the umask; a directory (or key file) others may use is refused at start-up with a message that
says what to do; temporary files never follow a planted link; a link or FIFO under a block's
name is never read through; and the directory's own key survives a restart (and only its loss
or the cluster key's arrival turns old blocks into misses)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from densa.cache.tiers import disk
from densa.cache.tiers.block import fingerprint_of
from densa.cache.tiers.disk import KEY_FILE, DiskTier
from densa.cache.tiers.tier import TierSetupError

FP = fingerprint_of("model-a", "fp32")
KEY = bytes(range(16))
PAGE = b"page" * 256


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_directory_is_made_0700_and_its_files_0600_even_under_umask_0(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    with umask(0):  # what an unset umask in a container gives: 0777 directories, 0666 files
        tier = DiskTier(str(directory), 1 << 20, FP)
        tier.put(KEY, PAGE)
    assert mode(directory) == 0o700
    files = list(directory.iterdir())
    assert {p.name for p in files} == {KEY_FILE, tier._file_name(KEY)}
    assert all(mode(p) == 0o600 for p in files)
    tier.close()


@pytest.mark.parametrize("loose", [0o755, 0o750, 0o711, 0o701, 0o770, 0o707])
def test_a_directory_group_or_others_may_use_is_refused_at_start_up(
    tmp_path: Path, loose: int
) -> None:
    directory = tmp_path / "kv"
    directory.mkdir()
    directory.chmod(loose)
    with pytest.raises(TierSetupError) as refused:
        DiskTier(str(directory), 1 << 20, FP)
    message = str(refused.value)
    assert f"mode {loose:04o}" in message and f"chmod 700 {directory}" in message
    assert not (directory / KEY_FILE).exists()  # nothing written into it


def test_a_directory_of_another_user_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(directory, 65534, 65534)  # nobody's
    else:  # without root, this server pretends to be another user instead
        monkeypatch.setattr(disk.os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(TierSetupError, match="belongs to uid"):
        DiskTier(str(directory), 1 << 20, FP)


@pytest.mark.parametrize("problem", ["loose-mode", "symlink", "wrong-size"])
def test_a_key_file_that_is_not_this_directorys_own_is_refused(
    tmp_path: Path, problem: str
) -> None:
    directory = tmp_path / "kv"
    DiskTier(str(directory), 1 << 20, FP).close()
    key_file = directory / KEY_FILE
    if problem == "loose-mode":
        key_file.chmod(0o644)
    elif problem == "symlink":
        outside = tmp_path / "someone-elses-key"
        outside.write_bytes(b"k" * 32)
        key_file.unlink()
        key_file.symlink_to(outside)
    else:
        key_file.write_bytes(b"short")
    with pytest.raises(TierSetupError, match="key file"):
        DiskTier(str(directory), 1 << 20, FP)


def test_a_temporary_file_never_follows_a_planted_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "kv"
    tier = DiskTier(str(directory), 1 << 20, FP)
    target = tmp_path / "precious"
    target.write_bytes(b"must stay as it is")
    planted = directory / ".tmp-planted"
    planted.symlink_to(target)
    monkeypatch.setattr(disk, "_temporary_name", lambda: planted.name)  # a name guessed ahead
    tier.put(KEY, PAGE)
    assert target.read_bytes() == b"must stay as it is"
    assert planted.is_symlink() and not tier.contains(KEY)
    assert tier.counters.write_errors == 1 and not tier.counters.disabled
    monkeypatch.undo()
    tier.put(KEY, PAGE)  # names are random again: the write lands
    assert bytes(tier.get(KEY) or b"") == PAGE
    tier.close()


def test_a_link_or_fifo_under_a_blocks_name_is_never_read(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    tier = DiskTier(str(directory), 1 << 20, FP)
    tier.put(KEY, PAGE)
    block = directory / tier._file_name(KEY)
    genuine = tmp_path / "a-genuine-block-elsewhere"
    genuine.write_bytes(block.read_bytes())
    block.unlink()
    block.symlink_to(genuine)  # under a name the tier has indexed
    assert tier.get(KEY) is None
    tier.close()
    again = DiskTier(str(directory), 1 << 20, FP)  # a restart: links are not indexed at all
    assert not again.contains(KEY) and again.get(KEY) is None
    block.unlink()
    os.mkfifo(block)  # a read that would block forever if it were opened for reading
    again._sizes[block.name] = 1  # as if indexed
    assert again.get(KEY) is None
    assert genuine.exists()
    again.close()


def test_the_directory_key_survives_a_restart_and_losing_it_makes_old_blocks_misses(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "kv"
    DiskTier(str(directory), 1 << 20, FP).put(KEY, PAGE)
    key = (directory / KEY_FILE).read_bytes()
    restarted = DiskTier(str(directory), 1 << 20, FP)
    assert bytes(restarted.get(KEY) or b"") == PAGE  # the key and the blocks came back
    assert (directory / KEY_FILE).read_bytes() == key
    restarted.close()
    (directory / KEY_FILE).unlink()
    rekeyed = DiskTier(str(directory), 1 << 20, FP)  # a fresh key: the old block is not ours
    assert (directory / KEY_FILE).read_bytes() != key
    assert rekeyed.get(KEY) is None
    assert rekeyed.counters.rejected_reasons == {"checksum": 1}
    assert not (directory / rekeyed._file_name(KEY)).exists()  # deleted as it was read
    rekeyed.close()


def test_blocks_of_another_directory_verify_only_under_the_cluster_key(tmp_path: Path) -> None:
    """A directory's own key is its own: a block copied in from another directory is a miss.
    Under the cluster's key, every worker's blocks are the cluster's."""
    cluster_key = b"c" * 32
    for mac_key, verifies in ((None, False), (cluster_key, True)):
        first, second = tmp_path / f"a-{verifies}", tmp_path / f"b-{verifies}"
        source = DiskTier(str(first), 1 << 20, FP, mac_key)
        source.put(KEY, PAGE)
        name = source._file_name(KEY)
        DiskTier(str(second), 1 << 20, FP, mac_key).close()
        (second / name).write_bytes((first / name).read_bytes())
        copy = DiskTier(str(second), 1 << 20, FP, mac_key)
        assert (copy.get(KEY) is not None) is verifies
        source.close()
        copy.close()


def test_unfinished_writes_of_a_live_server_on_the_same_directory_are_left_alone(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "kv"
    DiskTier(str(directory), 1 << 20, FP).close()
    live = directory / f".tmp-{os.getppid()}-0123456789abcdef"  # pytest's parent: alive
    dead = directory / ".tmp-999999999-0123456789abcdef"  # no such process
    ours_from_before = directory / f".tmp-{os.getpid()}-0123456789abcdef"  # a pid reused
    for path in (live, dead, ours_from_before):
        path.write_bytes(b"half a block")
    DiskTier(str(directory), 1 << 20, FP).close()
    assert live.exists() and not dead.exists() and not ours_from_before.exists()
