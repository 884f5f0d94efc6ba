"""The host tier (`--kv-tier host:SIZE`): blocks in process memory, capped in bytes with the
least recently used out first, and checked on every read like any tier's."""

from __future__ import annotations

import pytest

from densa.cache.tiers.block import BLOCK_OVERHEAD, BlockCodec, fingerprint_of
from densa.cache.tiers.host import HostTier
from densa.cache.tiers.tier import parse_tier_spec
from densa.setup.memory_plan import MemoryPlan, WeightPlan, host_tier_bytes

FP = fingerprint_of("model-a", "int8")
KEYS = [bytes([i]) * 16 for i in range(4)]
MAC_KEY = b"m" * 32


def test_round_trip_and_the_cap_drops_the_least_recently_used() -> None:
    block = BLOCK_OVERHEAD + 1000
    tier = HostTier(3 * block, FP)
    for i, key in enumerate(KEYS[:3]):
        tier.put(key, bytes([i]) * 1000)
    assert bytes(tier.get(KEYS[0]) or b"") == bytes([0]) * 1000  # refreshes KEYS[0]
    tier.put(KEYS[3], b"\x03" * 1000)  # over the cap: KEYS[1], the least recently used, goes
    assert [tier.contains(k) for k in KEYS] == [True, False, True, True]
    assert tier.total_bytes == 3 * block
    assert tier.get(KEYS[1]) is None
    stats = tier.counters.as_dict()
    assert (stats["hits"], stats["misses"], stats["blocks_written"]) == (1, 1, 4)


def test_a_damaged_or_foreign_block_is_a_miss() -> None:
    tier = HostTier(1 << 20, FP)
    tier.put(KEYS[0], b"a" * 500)
    stored = bytearray(tier._blocks[KEYS[0]])
    stored[-10] ^= 0x01  # a stray write into the stored bytes
    tier._blocks[KEYS[0]] = bytes(stored)
    assert tier.get(KEYS[0]) is None
    other_model = HostTier(1 << 20, fingerprint_of("model-b", "int8"), MAC_KEY)
    other_model._blocks[KEYS[1]] = BlockCodec(FP, MAC_KEY).encode(KEYS[1], b"b" * 500)
    assert other_model.get(KEYS[1]) is None
    assert tier.counters.rejected_reasons == {"checksum": 1}
    assert other_model.counters.rejected_reasons == {"fingerprint": 1}


def test_a_block_larger_than_the_tier_is_not_kept() -> None:
    tier = HostTier(100, FP)
    tier.put(KEYS[0], b"x" * 1000)
    assert not tier.contains(KEYS[0]) and tier.total_bytes == 0


def test_host_specs_and_the_memory_plan_counts_them() -> None:
    assert parse_tier_spec("host:4GiB").size_bytes == 4 * 1024**3
    for bad in ("host:", "host:lots"):
        with pytest.raises(ValueError, match="--kv-tier"):
            parse_tier_spec(bad)
    specs = ("host:1GiB", "disk:/var/kv:20GiB", "host:512MiB")
    assert host_tier_bytes(specs) == 1536 * 1024**2  # disk is not memory
    weights = WeightPlan(1000, 0, "dense")
    without = MemoryPlan(weights, kv_bytes=100, activation_bytes=10)
    with_host = MemoryPlan(weights, kv_bytes=100, activation_bytes=10, host_tier_bytes=5000)
    assert with_host.needed_bytes - without.needed_bytes == 5000
    assert "host KV tier" in with_host.describe()
