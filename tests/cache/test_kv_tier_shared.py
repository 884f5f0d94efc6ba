"""The shared tier against a real redis-server process: verified reads (MAC under the cluster
secret), and a store killed with SIGKILL and restarted: skipped while down, never a hang, used
again once back."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from densa.auth.secret import ClusterSecret
from densa.cache.tiers import shared
from densa.cache.tiers.block import BlockCodec, fingerprint_of
from densa.cache.tiers.shared import SharedTier
from densa_bench.common.redis_server import INSTALL_HINT, RedisServer, redis_server_binary

FP = fingerprint_of("model-a", "fp32")
KEY = bytes(range(16))
SECRET = ClusterSecret.generate()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    if redis_server_binary() is None:
        pytest.skip(INSTALL_HINT)
    with RedisServer(maxmemory="32mb") as running:
        yield running


def sealed_tier(url: str) -> SharedTier:
    return SharedTier(url, BlockCodec(FP, SECRET.key("kv-tier")))


def test_round_trip_and_a_store_value_altered_or_unsealed_is_a_miss(server: RedisServer) -> None:
    tier = sealed_tier(server.url)
    tier.put(KEY, b"p" * 4096)
    assert bytes(tier.get(KEY) or b"") == b"p" * 4096
    client = redis.Redis.from_url(server.url)
    (stored_key,) = client.keys(b"densa:kv:*")
    client.setrange(stored_key, 200, b"X")  # altered in the store
    assert tier.get(KEY) is None
    client.set(stored_key, BlockCodec(FP).encode(KEY, b"p" * 4096))  # sealed without the secret
    assert tier.get(KEY) is None
    client.set(stored_key, client.get(stored_key)[:100])  # truncated
    assert tier.get(KEY) is None
    other = SharedTier(server.url, BlockCodec(FP, ClusterSecret.generate().key("kv-tier")))
    other.put(KEY, b"q" * 4096)  # another cluster's secret
    assert tier.get(KEY) is None
    stats = tier.counters.as_dict()
    assert (stats["hits"], stats["rejected"]) == (1, 4)
    assert tier.counters.rejected_reasons == {"checksum": 3, "truncated": 1}


def test_a_killed_store_is_skipped_fast_and_used_again_when_back(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared, "RETRY_AFTER_S", 0.3)
    tier = sealed_tier(server.url)
    tier.put(KEY, b"a" * 1000)
    server.kill()
    started = time.monotonic()
    assert tier.get(KEY) is None  # one failed call...
    for _ in range(100):  # ...then no call at all while it is marked down
        assert tier.get(KEY) is None
        tier.put(KEY, b"b" * 1000)
    assert time.monotonic() - started < 2.0
    assert tier.is_down
    server.restart()  # empty: no persistence
    time.sleep(0.35)
    assert tier.get(KEY) is None  # answered: a plain miss
    tier.put(KEY, b"c" * 1000)
    assert bytes(tier.get(KEY) or b"") == b"c" * 1000
    assert not tier.is_down


def test_the_store_id_is_equal_only_for_the_same_store_model_and_secret() -> None:
    """What a worker tells routers (no server needed: the client connects lazily)."""
    url = "redis://10.0.0.5:6379/0"
    same = {sealed_tier(url).store_id, sealed_tier(url).store_id}
    assert len(same) == 1 and len(same.pop()) == 16
    others = [
        sealed_tier("redis://10.0.0.6:6379/0"),  # another store
        SharedTier(url, BlockCodec(fingerprint_of("model-b", "fp32"), SECRET.key("kv-tier"))),
        SharedTier(url, BlockCodec(FP, ClusterSecret.generate().key("kv-tier"))),  # another cluster
    ]
    ids = {sealed_tier(url).store_id} | {tier.store_id for tier in others}
    assert len(ids) == 4
    assert all("10.0.0" not in i for i in ids)  # the address is not readable from it
