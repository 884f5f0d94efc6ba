"""The disk tier and the stored block format, without a model: every check on read, the size
cap, faults that disable the tier, and a writer killed with SIGKILL mid-write. (Privacy of the
directory and its key: test_kv_tier_privacy.py; forged and replayed blocks on every tier:
test_kv_tier_forgery.py.)"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from densa.cache.tiers import disk
from densa.cache.tiers.block import BLOCK_OVERHEAD, BlockCodec, BlockRejected, fingerprint_of
from densa.cache.tiers.disk import TMP_PREFIX, DiskTier
from densa.cache.tiers.tier import parse_tier_spec

FP = fingerprint_of("model-a", "fp32")
KEY = bytes(range(16))
OTHER_KEY = bytes(range(1, 17))
MAC_KEY = b"k" * 32


def test_a_block_round_trips_and_every_field_is_checked() -> None:
    codec = BlockCodec(FP, MAC_KEY)
    data = codec.encode(KEY, b"page bytes" * 10)
    assert bytes(codec.decode(KEY, data)) == b"page bytes" * 10
    assert len(data) == BLOCK_OVERHEAD + 100
    other_model = BlockCodec(fingerprint_of("model-b", "fp32"), MAC_KEY)
    cases = {
        "key": (OTHER_KEY, data),
        "fingerprint": (KEY, other_model.encode(KEY, b"x" * 100)),
        "truncated": (KEY, data[:-1]),
        "format": (KEY, b"XXXX" + data[4:]),
        "checksum": (KEY, data[:-1] + bytes([data[-1] ^ 1])),
    }
    for reason, (key, blob) in cases.items():
        with pytest.raises(BlockRejected) as caught:
            codec.decode(key, blob)
        assert caught.value.reason == reason
    # A header field changed with the MAC left alone: the MAC covers the header.
    relabelled = bytearray(data)
    relabelled[40] ^= 1  # the length
    with pytest.raises(BlockRejected):
        codec.decode(KEY, bytes(relabelled))


def test_a_block_sealed_under_another_key_is_refused_and_no_codec_is_unkeyed() -> None:
    sealed = BlockCodec(FP, MAC_KEY)
    other = BlockCodec(FP, b"o" * 32).encode(KEY, b"y" * 64)
    with pytest.raises(BlockRejected) as caught:
        sealed.decode(KEY, other)
    assert caught.value.reason == "checksum"
    assert bytes(sealed.decode(KEY, sealed.encode(KEY, b"y" * 64))) == b"y" * 64
    for weak in (b"", b"short"):
        with pytest.raises(ValueError, match="MAC key"):
            BlockCodec(FP, weak)
    assert "kkkk" not in repr(sealed)  # the key is never printed


def test_tier_specs() -> None:
    spec = parse_tier_spec("disk:/var/kv:2GiB")
    assert (spec.kind, spec.path, spec.size_bytes) == ("disk", "/var/kv", 2 * 1024**3)
    store = parse_tier_spec("shared:redis://10.0.0.1:6379/2").store
    assert store is not None and (store.host, store.port, store.db) == ("10.0.0.1", 6379, 2)
    assert store.location == "redis://10.0.0.1:6379"
    for bad in ("disk:/var/kv", "disk:/var/kv:0", "shared:http://x", "tape:/dev/st0",
                "shared:redis://h:6379/x", "shared:redis://h:port/0", "shared:redis://h/0?a=b"):  # fmt: skip
        with pytest.raises(ValueError, match="--kv-tier"):
            parse_tier_spec(bad)


def test_a_password_in_a_tier_spec_is_kept_but_never_shown() -> None:
    spec = parse_tier_spec("shared:redis://user:hunter2@10.0.0.1:6379/0")
    assert spec.store is not None and spec.store.password == "hunter2"
    assert spec.store.username == "user"
    assert "hunter2" not in repr(spec) and "hunter2" not in spec.store.location
    for bad in ("shared:redis://:hunter2@h:6379/x", "shared:redis://:hunter2@h:port",
                "shared:redis://:hun/ter2@h:6379/0", "shared:rediss://:hunter2@h"):  # fmt: skip
        with pytest.raises(ValueError) as caught:
            parse_tier_spec(bad)
        assert "hunter2" not in str(caught.value) and "ter2" not in str(caught.value)
        assert "***@" in str(caught.value)
    with pytest.raises(ValueError, match="given twice"):
        spec.store.with_password("from-a-file")


def test_the_size_cap_drops_the_least_recently_used(tmp_path: Path) -> None:
    block = BLOCK_OVERHEAD + 1000
    tier = DiskTier(str(tmp_path), 3 * block, FP)
    keys = [bytes([i]) * 16 for i in range(4)]
    for key in keys[:3]:
        tier.put(key, bytes(1000))
    assert tier.get(keys[0]) is not None  # 0 is now the most recent: 1 goes first
    tier.put(keys[3], bytes(1000))
    assert [tier.contains(k) for k in keys] == [True, False, True, True]
    assert tier.total_bytes == 3 * block
    assert len(list(tmp_path.glob("*.kvb"))) == 3
    # A second tier over the same directory (a restart) finds the same blocks.
    again = DiskTier(str(tmp_path), 3 * block, FP)
    assert [again.contains(k) for k in keys] == [True, False, True, True]
    assert again.get(keys[3]) is not None


def test_a_corrupt_file_is_a_miss_counted_and_removed(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20, FP)
    tier.put(KEY, b"z" * 500)
    (path,) = tmp_path.glob("*.kvb")
    path.write_bytes(path.read_bytes()[:-10])
    assert tier.get(KEY) is None
    assert not path.exists()
    stats = tier.counters.as_dict()
    assert (stats["hits"], stats["misses"], stats["rejected"]) == (0, 1, 1)
    assert tier.counters.rejected_reasons == {"truncated": 1}


def test_an_unusable_directory_disables_the_tier(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    tier = DiskTier(str(not_a_dir / "kv"), 1 << 20, FP)
    assert tier.counters.disabled
    tier.put(KEY, b"a" * 10)  # no error: the tier is off
    assert tier.get(KEY) is None


def test_a_full_disk_disables_the_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20, FP)
    tier.put(KEY, b"a" * 10)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "write_all", full)
    tier.put(OTHER_KEY, b"b" * 10)
    monkeypatch.undo()
    assert tier.counters.disabled
    assert not tier.contains(OTHER_KEY)
    assert not any(p.name.startswith(TMP_PREFIX) for p in tmp_path.iterdir())


WRITER = textwrap.dedent(
    """
    import sys, time
    from densa.cache.tiers import disk
    from densa.cache.tiers.block import fingerprint_of
    from densa.cache.tiers.disk import DiskTier

    real_write_all = disk.write_all

    def stall_on_the_fourth(fd, data, _calls=[0]):  # the fourth block: half written, then a hang
        _calls[0] += 1
        if _calls[0] < 4:
            return real_write_all(fd, data)
        real_write_all(fd, data[: len(data) // 2])
        print("mid-write", flush=True)
        time.sleep(3600)

    tier = DiskTier(sys.argv[1], 1 << 30, fingerprint_of("model-a", "fp32"))
    disk.write_all = stall_on_the_fourth  # after the key file was written
    payload = bytes(range(256)) * 4096  # 1 MiB
    for i in range(4):
        tier.put(i.to_bytes(16, "big"), payload)
    """
)


def test_a_writer_killed_mid_write_leaves_no_visible_block(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "mid-write"  # blocks until the stall (or exit)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert leftovers, "the kill did not land mid-write"
    payload = bytes(range(256)) * 4096
    tier = DiskTier(str(tmp_path), 1 << 30, FP)
    blocks = list(tmp_path.glob("*.kvb"))
    assert len(blocks) == 3  # the three whole writes before the stall
    for i in range(len(blocks)):  # every visible block is whole and verifies
        found = tier.get(i.to_bytes(16, "big"))
        assert found is not None and bytes(found) == payload
    assert tier.counters.rejected == 0
    assert not any(p.name.startswith(TMP_PREFIX) for p in tmp_path.iterdir())  # cleaned at start
