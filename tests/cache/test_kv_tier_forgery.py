"""Every tier refuses what it did not write for that block: a forged block (chosen K/V with a
valid header: what an unkeyed checksum let anyone with access to a tier's storage inject), a
replayed one (another block's value, or another tenant's value for the same tokens, put under
this key), a truncated one and a damaged one are misses, counted by reason and logged with it.
The same five on the host tier, the disk tier (its own directory key, and the cluster's key)
and the shared tier (a real redis-server)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from densa.auth.secret import ClusterSecret
from densa.cache.prefix_index import hash_block
from densa.cache.scope import CacheScope
from densa.cache.tiers import block
from densa.cache.tiers.block import BlockCodec, fingerprint_of
from densa.cache.tiers.disk import DiskTier
from densa.cache.tiers.host import HostTier
from densa.cache.tiers.shared import SharedTier
from densa.cache.tiers.tier import KVTier, StoreAddress
from densa_bench.common.redis_server import INSTALL_HINT, RedisServer, redis_server_binary

FP = fingerprint_of("model-a", "int8")
CLUSTER_KEY = ClusterSecret.generate().key("kv-tier")
TOKENS = list(range(300, 316))  # one page of 16 tokens
KEY = hash_block(None, TOKENS, CacheScope(tenant="tenant-a").digest())
OTHER_TENANTS_KEY = hash_block(None, TOKENS, CacheScope(tenant="tenant-b").digest())
OTHER_BLOCKS_KEY = hash_block(KEY, list(range(400, 416)), CacheScope(tenant="tenant-a").digest())
PAGE = bytes(range(256)) * 16
CHOSEN = b"\x7f" * len(PAGE)  # the K/V an attacker wants attended to


@dataclass
class Harness:
    """A tier, and its storage as someone with access to it sees it."""

    tier: KVTier
    stored: Callable[[bytes], bytes]  # the raw bytes kept under a block key
    plant: Callable[[bytes, bytes], None]  # put raw bytes under a block key


def _host(mac_key: bytes | None) -> Harness:
    tier = HostTier(1 << 20, FP, mac_key)

    def plant(key: bytes, data: bytes) -> None:
        tier._blocks[key] = data

    return Harness(tier, lambda key: tier._blocks[key], plant)


class DiskHarness(Harness):
    """Bytes are planted as files in the directory, then the server restarts (a restored
    backup, another user's write): the new tier indexes what it finds."""

    def __init__(self, directory: Path, mac_key: bytes | None) -> None:
        self.directory = directory
        self.mac_key = mac_key
        super().__init__(self._open(), self._stored, self._plant)

    def _open(self) -> DiskTier:
        return DiskTier(str(self.directory), 1 << 24, FP, self.mac_key)

    def _path(self, key: bytes) -> Path:
        assert isinstance(self.tier, DiskTier)
        return self.directory / self.tier._file_name(key)

    def _stored(self, key: bytes) -> bytes:
        return self._path(key).read_bytes()

    def _plant(self, key: bytes, data: bytes) -> None:
        self._path(key).write_bytes(data)
        self.tier.close()
        self.tier = self._open()


def _shared(server: RedisServer) -> Harness:
    tier = SharedTier(StoreAddress.parse(server.url), FP, CLUSTER_KEY)
    client = redis.Redis.from_url(server.url)
    prefix = tier._prefix
    return Harness(tier, lambda key: client.get(prefix + key),
                   lambda key, data: client.set(prefix + key, data))  # fmt: skip


@pytest.fixture(params=["host", "host-cluster-key", "disk", "disk-cluster-key", "shared"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    kind = request.param
    if kind == "shared":
        if redis_server_binary() is None:
            pytest.skip(INSTALL_HINT)
        with RedisServer(maxmemory="32mb") as server:
            made = _shared(server)
            yield made
            made.tier.close()
        return
    mac_key = CLUSTER_KEY if kind.endswith("cluster-key") else None
    made = _host(mac_key) if kind.startswith("host") else DiskHarness(tmp_path / "tier", mac_key)
    yield made
    made.tier.close()


def forged_with_a_key(data_key: bytes) -> bytes:
    """A well-formed block for KEY and this engine's fingerprint, MAC'd under another key."""
    return BlockCodec(FP, data_key).encode(KEY, CHOSEN)


def forged_unkeyed() -> bytes:
    """What passed before tiers were keyed: a plain BLAKE2b over header and payload."""
    header = block.MAGIC + bytes([block.VERSION, 0, 0, 0]) + KEY + FP
    header += len(CHOSEN).to_bytes(8, "little")
    checksum = hashlib.blake2b(header + CHOSEN, digest_size=block.CHECKSUM_BYTES).digest()
    return header + checksum + CHOSEN


def attack(name: str, harness: Harness) -> bytes:
    """The bytes planted under KEY for each attack; genuine ones are the tier's own writes."""
    tier = harness.tier
    if name == "forged":
        return forged_with_a_key(b"an attacker's key, 32 bytes long")
    if name == "forged-unkeyed":
        return forged_unkeyed()
    if name == "another-blocks-value":
        tier.put(OTHER_BLOCKS_KEY, CHOSEN)
        return harness.stored(OTHER_BLOCKS_KEY)
    if name == "another-tenants-value":
        tier.put(OTHER_TENANTS_KEY, CHOSEN)
        return harness.stored(OTHER_TENANTS_KEY)
    tier.put(KEY, PAGE)
    genuine = harness.stored(KEY)
    if name == "truncated":
        return genuine[: len(genuine) // 2]
    assert name == "damaged"
    damaged = bytearray(genuine)
    damaged[-100] ^= 0x01  # one bit of the payload
    return bytes(damaged)


REASONS = {
    "forged": "checksum",
    "forged-unkeyed": "checksum",
    "another-blocks-value": "key",
    "another-tenants-value": "key",
    "truncated": "truncated",
    "damaged": "checksum",
}


@pytest.mark.parametrize("name", list(REASONS))
def test_a_block_the_tier_did_not_write_for_this_key_is_a_miss_counted_and_logged(
    harness: Harness, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    planted = attack(name, harness)
    harness.plant(KEY, planted)
    tier = harness.tier
    with caplog.at_level(logging.WARNING, logger="densa.kv_tiers"):
        assert tier.get(KEY) is None
    reason = REASONS[name]
    assert tier.counters.rejected_reasons == {reason: 1}
    stats = tier.counters.as_dict()
    assert (stats["hits"], stats["misses"], stats["rejected"], stats[f"rejected_{reason}"]) == (
        0,
        1,
        1,
        1,
    )
    (line,) = [r.getMessage() for r in caplog.records if "failed its check" in r.getMessage()]
    assert f"reason {reason}" in line and tier.name in line
    tier.put(KEY, PAGE)  # the tier's own write for the key is a hit again
    assert bytes(tier.get(KEY) or b"") == PAGE


def test_each_reason_is_logged_again_after_a_quiet_while(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store full of forgeries does not flood the log, and a later one is not silent."""
    from densa.cache.tiers import tier as tier_module

    monkeypatch.setattr(tier_module, "REJECT_LOG_EVERY_S", 0.5)
    harness = _host(None)
    with caplog.at_level(logging.WARNING, logger="densa.kv_tiers"):
        for _ in range(5):  # microseconds apart: one line
            harness.plant(KEY, forged_unkeyed())
            assert harness.tier.get(KEY) is None
        time.sleep(0.6)
        harness.plant(KEY, forged_unkeyed())
        assert harness.tier.get(KEY) is None
    lines = [r.getMessage() for r in caplog.records if "failed its check" in r.getMessage()]
    assert len(lines) == 2 and "4 more since the last such line" in lines[1]
    assert harness.tier.counters.rejected == 6
