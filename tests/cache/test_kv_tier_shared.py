"""The shared tier against a real redis-server process: verified reads (MAC under the cluster
secret), a store killed with SIGKILL and restarted (skipped while down, never a hang, used again
once back), a store that drips its answer (cut at the call's deadline), and the store's password
(used, and shown nowhere: not in the tier's name, its errors or its log lines)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import redis

from densa.auth.secret import ClusterSecret
from densa.cache.tiers import shared
from densa.cache.tiers.block import BlockCodec, fingerprint_of
from densa.cache.tiers.shared import SharedTier
from densa.cache.tiers.tier import StoreAddress
from densa_bench.common.drip_store import DripStore
from densa_bench.common.redis_server import INSTALL_HINT, RedisServer, redis_server_binary

FP = fingerprint_of("model-a", "fp32")
KEY = bytes(range(16))
SECRET = ClusterSecret.generate()
PASSWORD = "planted-store-password-0451"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    if redis_server_binary() is None:
        pytest.skip(INSTALL_HINT)
    with RedisServer(maxmemory="32mb") as running:
        yield running


def sealed_tier(url: str, **options: float) -> SharedTier:
    return SharedTier(StoreAddress.parse(url), FP, SECRET.key("kv-tier"), **options)


def test_round_trip_and_a_store_value_altered_or_unsealed_is_a_miss(server: RedisServer) -> None:
    tier = sealed_tier(server.url)
    tier.put(KEY, b"p" * 4096)
    assert bytes(tier.get(KEY) or b"") == b"p" * 4096
    client = redis.Redis.from_url(server.url)
    (stored_key,) = client.keys(b"densa:kv:*")
    client.setrange(stored_key, 200, b"X")  # altered in the store
    assert tier.get(KEY) is None
    client.set(stored_key, BlockCodec(FP, b"x" * 32).encode(KEY, b"p" * 4096))  # another key
    assert tier.get(KEY) is None
    client.set(stored_key, client.get(stored_key)[:100])  # truncated
    assert tier.get(KEY) is None
    other = SharedTier(StoreAddress.parse(server.url), FP, ClusterSecret.generate().key("kv-tier"))
    other.put(KEY, b"q" * 4096)  # another cluster's secret
    assert tier.get(KEY) is None
    stats = tier.counters.as_dict()
    assert (stats["hits"], stats["rejected"]) == (1, 4)
    assert tier.counters.rejected_reasons == {"checksum": 3, "truncated": 1}
    assert (stats["rejected_checksum"], stats["rejected_truncated"], stats["rejected_key"]) == (
        3,
        1,
        0,
    )


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


def test_a_connection_the_store_closed_while_idle_is_replaced_not_failed(
    server: RedisServer,
) -> None:
    """A restart between two calls (each reader thread and the writer keep a connection): the
    next call notices the closed connection before using it, so no hit is lost for it."""
    tier = sealed_tier(server.url)
    tier.put(KEY, b"a" * 1000)
    server.restart()
    tier.put(KEY, b"b" * 1000)
    assert bytes(tier.get(KEY) or b"") == b"b" * 1000
    assert not tier.is_down and tier.counters.write_errors == 0


def test_a_store_that_drips_its_answer_is_cut_at_the_calls_deadline() -> None:
    """The store sends a byte every 20 ms, well within any per-recv timeout, for up to 30 s: the
    call still ends at its deadline (0.3 s), counted as a timeout, and the tier is skipped."""
    with DripStore(drip_interval_s=0.02, max_drip_s=30) as store:
        tier = sealed_tier(store.url, timeout_s=0.3)
        tier.put(KEY, b"a" * 1000)  # answered at once: writes and connects work
        assert tier.counters.blocks_written == 1
        started = time.monotonic()
        assert tier.get(KEY) is None
        elapsed = time.monotonic() - started
        assert store.num_gets == 1
        assert 0.25 <= elapsed < 3.0, elapsed  # the deadline, not the drip's 30 s
        assert tier.counters.as_dict()["timeouts"] == 1
        assert tier.is_down
        tier.close()


def test_the_password_reaches_the_store_and_appears_nowhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if redis_server_binary() is None:
        pytest.skip(INSTALL_HINT)
    with RedisServer(maxmemory="32mb", password=PASSWORD) as server:
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        tier = sealed_tier(url)
        tier.put(KEY, b"p" * 4096)
        assert bytes(tier.get(KEY) or b"") == b"p" * 4096  # AUTH worked
        assert tier.name == f"shared:redis://127.0.0.1:{server.port}"  # scheme and host only
        wrong = sealed_tier(f"redis://:not-{PASSWORD}@127.0.0.1:{server.port}/0")
        with caplog.at_level(logging.WARNING, logger="densa.kv_tiers"):
            assert wrong.get(KEY) is None  # refused by the store: a miss, logged once
        assert "WRONGPASS" in caplog.text and PASSWORD not in caplog.text
        shown = [tier.name, repr(StoreAddress.parse(url)), tier.store_id, caplog.text,
                 *map(str, tier.counters.as_dict())]  # fmt: skip
        assert not [text for text in shown if PASSWORD in text]
        tier.close()
        wrong.close()


def test_the_store_id_is_equal_only_for_the_same_store_model_and_secret() -> None:
    """What a worker tells routers (no server needed: the client connects lazily)."""
    url = "redis://10.0.0.5:6379/0"
    same = {sealed_tier(url).store_id, sealed_tier(url).store_id}
    assert len(same) == 1 and len(same.pop()) == 16
    address = StoreAddress.parse(url)
    others = [
        sealed_tier("redis://10.0.0.6:6379/0"),  # another store
        sealed_tier("redis://10.0.0.5:6379/1"),  # another database of it
        SharedTier(address, fingerprint_of("model-b", "fp32"), SECRET.key("kv-tier")),
        SharedTier(address, FP, ClusterSecret.generate().key("kv-tier")),  # another cluster
    ]
    ids = {sealed_tier(url).store_id} | {tier.store_id for tier in others}
    assert len(ids) == 5
    assert all("10.0.0" not in i for i in ids)  # the address is not readable from it
    # A password changes nothing: every worker must agree whatever it was given.
    assert sealed_tier(f"redis://:{PASSWORD}@10.0.0.5:6379/0").store_id == sealed_tier(url).store_id
