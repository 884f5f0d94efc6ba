"""KV tiers through the engine (bundled SmolLM2-135M, greedy): a prefix evicted from a tiny
device pool comes back from the disk tier instead of being recomputed, with tokens identical to a
run without tiers; a corrupted, truncated or forged block is a miss (same tokens); another
tenant never hits what one tenant's requests stored; a store that drips its answers costs the
request that asked only its hits, and never delays another tenant's request."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from densa.engine.hooks import StepRecord
from densa.engine.llm_engine import LLMEngine
from densa.engine.metrics import snapshot
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs

from ..outputs import Collector, Final

PAGE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base_engine() -> LLMEngine:
    # 16 pages of 16 tokens: one 100-token prompt takes 7, so three other prompts evict it.
    args = EngineArgs(num_kv_pages=16, page_size=PAGE, max_model_len=256, max_num_seqs=4,
                      max_num_batched_tokens=256)  # fmt: skip
    return LLMEngine.from_args(args)


@pytest.fixture
def make_engine(base_engine: LLMEngine):
    """The module's engine with an empty prefix cache and the tiers asked for (one model load
    for the whole file)."""

    def make(tiers: tuple[str, ...] = ()) -> LLMEngine:
        base_engine.detach_tiers()
        base_engine.kv_manager.reset_prefix_cache()
        base_engine.observers.clear()
        if tiers:
            base_engine.attach_tiers(tiers, None)
        return base_engine

    yield make
    base_engine.detach_tiers()


class Runner:
    """Runs one request at a time to the end; counts the prompt tokens each run computed."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_computed = 0
        engine.observers.add(self._observe)

    def _observe(self, record: StepRecord) -> None:
        self.num_computed += sum(len(chunk.token_ids) for chunk in record.step.scheduled)

    def run(self, prompt: list[int], scope: str = "") -> tuple[Final, int]:
        before = self.num_computed
        collector = Collector()
        request_id = self.engine.add_request(prompt, GREEDY, cache_scope=scope)
        while request_id not in collector.finals:
            collector.add(self.engine.step())
            self.engine.check_invariants()
        if self.engine.kv_tiers is not None:
            self.engine.kv_tiers.flush()  # write-back is asynchronous: let it land
        return collector.finals[request_id], self.num_computed - before


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 20000) for _ in range(100)] for _ in range(4)]


def evict_then_return(runner: Runner, scope_back: str = "") -> tuple[Final, Final, int]:
    """Run A, three others (A's pages get reused), then A again (in `scope_back`)."""
    first, *others = prompts(0)
    original, _ = runner.run(first)
    for other in others:
        runner.run(other)
    again, computed = runner.run(first, scope_back)
    return original, again, computed


_REFERENCE: list[tuple[Final, Final, int]] = []


@pytest.fixture
def reference(make_engine) -> tuple[Final, Final, int]:
    """The run without tiers (once per module)."""
    if not _REFERENCE:
        _REFERENCE.append(evict_then_return(Runner(make_engine())))
    return _REFERENCE[0]


def test_an_evicted_prefix_comes_back_from_disk(tmp_path: Path, reference, make_engine) -> None:
    """... through the step contract: the tiers hold no device KV. Pages go down as a KVExport
    the runner answers in its output (packed before the step wrote any page) and come up as a
    KVLanding in the step, as a prefill worker's pages do (no request starts from it)."""
    _, ref_again, ref_computed = reference
    assert ref_again.num_cached_tokens == 0  # without tiers, the pool really lost it
    engine = make_engine((f"disk:{tmp_path}:64MiB",))
    exported: list[int] = []
    landed: list[list[int]] = []

    def observe(record: StepRecord) -> None:
        for export in record.step.kv_exports:
            assert record.output.exported[export.export_id].shape[2] == len(export.page_ids)
            exported.extend(export.page_ids)
        landed.extend(x.page_ids for x in record.step.kv_landings if not x.starts_request)
        assert not any(rid.startswith("kv-tier") for rid in record.output.errors)

    engine.observers.add(observe)
    original, again, computed = evict_then_return(Runner(engine))
    assert original.token_ids == again.token_ids == ref_again.token_ids
    assert again.num_cached_tokens == 96  # 6 full pages; the last token is always computed
    assert computed == ref_computed - 96
    stats = engine.kv_tiers.stats()[f"disk:{tmp_path}"]
    assert stats["hits"] == 6 and stats["rejected"] == 0
    assert stats["blocks_written"] >= 4 * 6  # every prompt's full pages, once each
    assert engine.kv_tiers.num_fetched_pages == 6
    assert len(exported) >= 4 * 6  # each block written went down in some step's export
    assert [len(pages) for pages in landed] == [6]  # A's six blocks came up in one landing


@pytest.mark.parametrize("damage", ["flip", "truncate", "forge"])
def test_a_damaged_block_is_a_miss_with_identical_output(
    tmp_path: Path, reference, make_engine, damage: str
) -> None:
    engine = make_engine((f"disk:{tmp_path}:64MiB",))
    runner = Runner(engine)
    first, *others = prompts(0)
    runner.run(first)
    for other in others:
        runner.run(other)
    tier = engine.kv_tiers.tiers[0]
    # Damage A's fourth block: blocks 0-2 still come back, 3 is a miss, so 4-5 are computed too.
    key = engine.kv_manager.prefix_hashes(engine_request(engine, first))[3]
    path = tier.directory / tier._file_name(key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1000] ^= 0x01
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:  # chosen K/V (zeros) under the file's own header: a hit before tiers were keyed
        data = bytearray(forged_like(bytes(data)))
    path.write_bytes(bytes(data))
    again, _ = runner.run(first)
    assert again.token_ids == reference[1].token_ids
    assert again.num_cached_tokens == 3 * PAGE
    stats = engine.kv_tiers.stats()[tier.name]
    assert stats["rejected"] == 1
    assert not path.exists() or path.read_bytes() != bytes(data)  # removed (or rewritten whole)


def test_another_tenant_never_hits_and_the_same_tenant_does(
    tmp_path: Path, reference, make_engine
) -> None:
    engine = make_engine((f"disk:{tmp_path}:64MiB",))
    runner = Runner(engine)
    first, *others = prompts(0)
    runner.run(first, scope="tenant-a")
    for other in others:
        runner.run(other, scope="tenant-a")
    other_tenant, _ = runner.run(first, scope="tenant-b")
    same_tenant, _ = runner.run(first, scope="tenant-a")
    assert other_tenant.num_cached_tokens == 0
    assert same_tenant.num_cached_tokens == 96
    assert other_tenant.token_ids == same_tenant.token_ids == reference[1].token_ids


def test_tiers_on_and_off_give_the_same_tokens_under_pressure(tmp_path: Path, make_engine) -> None:
    """Mixed traffic (shared system prefixes, several requests at once, preemption) in both."""
    rng = random.Random(7)
    system = [[rng.randrange(300, 20000) for _ in range(40)] for _ in range(3)]
    cases = [system[i % 3] + [rng.randrange(300, 20000) for _ in range(rng.randrange(5, 60))]
             for i in range(6)]  # fmt: skip
    results = []
    for tiers in ((), (f"disk:{tmp_path}:64MiB",)):
        engine = make_engine(tiers)
        collector = Collector()
        ids = []
        for _ in range(2):  # the second round returns after the first was evicted
            ids += [engine.add_request(c, GREEDY) for c in cases]
            while any(i not in collector.finals for i in ids):
                collector.add(engine.step())
                engine.check_invariants()
            if engine.kv_tiers is not None:
                engine.kv_tiers.flush()
        results.append([collector.finals[i].token_ids for i in ids])
        results.append(sum(collector.finals[i].num_cached_tokens for i in ids))
    off_tokens, off_cached, on_tokens, on_cached = results
    assert on_tokens == off_tokens
    assert on_cached > off_cached


def forged_like(genuine: bytes) -> bytes:
    """What anyone who can write the directory could make of a block: its header (key and
    fingerprint are in the clear), a payload of their choice and a plain BLAKE2b over both."""
    import hashlib

    from densa.cache.tiers.block import BLOCK_OVERHEAD, CHECKSUM_BYTES, HEADER_BYTES

    header, payload = genuine[:HEADER_BYTES], bytes(len(genuine) - BLOCK_OVERHEAD)
    checksum = hashlib.blake2b(header + payload, digest_size=CHECKSUM_BYTES).digest()
    return header + checksum + payload


def engine_request(engine: LLMEngine, prompt: list[int]):
    """A throwaway Request with `prompt` in the default scope, to compute its block hashes."""
    from densa.request import Request

    return Request(request_id="probe", prompt_token_ids=prompt, sampling_params=GREEDY)


def test_the_shared_tier_serves_each_tenant_its_own_and_survives_the_store_dying(
    tmp_path: Path, reference, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from densa.auth.secret import SECRET_ENV, ClusterSecret
    from densa.cache.tiers import shared
    from densa_bench.common.redis_server import INSTALL_HINT, RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip(INSTALL_HINT)
    monkeypatch.setenv(SECRET_ENV, ClusterSecret.generate().value.decode())
    monkeypatch.setattr(shared, "RETRY_AFTER_S", 0.2)
    with RedisServer(maxmemory="64mb") as server:
        engine = make_engine((f"shared:{server.url}",))
        # What the worker tells routers about its store (/densa/load): the tier's keyed id.
        assert snapshot(engine).shared_kv_tier == engine.kv_tiers.tiers[0].store_id != ""
        runner = Runner(engine)
        first, *others = prompts(0)
        runner.run(first, scope="tenant-a")
        for other in others:
            runner.run(other, scope="tenant-a")
        assert runner.run(first, scope="tenant-b")[0].num_cached_tokens == 0
        back, _ = runner.run(first, scope="tenant-a")
        assert back.num_cached_tokens == 96
        assert back.token_ids == reference[1].token_ids
        server.kill()  # mid-run: the next turns are computed, with the same tokens
        for other in others:
            runner.run(other)
        started = time.monotonic()
        down, _ = runner.run(first)
        assert down.num_cached_tokens == 0 and down.token_ids == reference[1].token_ids
        assert time.monotonic() - started < 30
        server.restart()  # empty, and up again: write-back and fetch resume
        time.sleep(0.3)
        runner.run(first)  # its blocks go down again (the earlier writes went nowhere)
        for other in others:
            runner.run(other)
        again, _ = runner.run(first)
        assert again.num_cached_tokens == 96 and again.token_ids == reference[1].token_ids
        stats = engine.kv_tiers.stats()[f"shared:redis://127.0.0.1:{server.port}"]
        assert stats["rejected"] == 0 and stats["hits"] >= 12  # the others come back too


def test_a_fetch_runs_beside_the_running_requests(
    tmp_path: Path, reference, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's evicted prefix is read from the tier on the reader thread while B keeps decoding:
    A is held (not admitted, not computed) until the lookup ends, then hits all 6 blocks."""
    import threading

    from densa.engine import kv_tiers

    # The test decides when the lookup ends: no deadline may end it first on a loaded machine.
    monkeypatch.setattr(kv_tiers, "LOOKUP_DEADLINE_S", 120.0)
    engine = make_engine((f"disk:{tmp_path}:64MiB",))
    runner = Runner(engine)
    first, *others = prompts(0)
    for prompt in (first, *others):  # A's blocks go down, and A is evicted from the pool
        runner.run(prompt)
    tier = engine.kv_tiers.tiers[0]
    readers: list[str] = []
    lookup_may_end = threading.Event()
    real_get = tier.get

    def slow_get(key):  # the first block waits until B has decoded beside the lookup
        readers.append(threading.current_thread().name)
        lookup_may_end.wait(timeout=30)
        return real_get(key)

    monkeypatch.setattr(tier, "get", slow_get)
    collector = Collector()
    b_id = engine.add_request(others[0][:20], SamplingParams(max_tokens=40, temperature=0.0))
    collector.add(engine.step())  # B's prompt
    a_id = engine.add_request(first, GREEDY)
    b_tokens_before = len(collector.tokens.get(b_id, []))
    for _ in range(3):  # A's lookup is under way: B decodes, A waits
        collector.add(engine.step())
        assert a_id in engine.scheduler.fetching
        assert engine.scheduler.requests[a_id].num_computed_tokens == 0
    assert len(collector.tokens[b_id]) >= b_tokens_before + 3
    lookup_may_end.set()
    while a_id not in collector.finals or b_id not in collector.finals:
        collector.add(engine.step())
        engine.check_invariants()
    assert readers and all(name.startswith("kv-tier-read") for name in readers)
    assert collector.finals[a_id].num_cached_tokens == 96
    assert collector.finals[a_id].token_ids == reference[1].token_ids
    assert not engine.scheduler.fetching


def test_an_evicted_prefix_comes_back_from_host_memory(reference, make_engine) -> None:
    engine = make_engine(("host:64MiB",))
    original, again, computed = evict_then_return(Runner(engine))
    assert original.token_ids == again.token_ids == reference[1].token_ids
    assert again.num_cached_tokens == 96
    assert computed == reference[2] - 96
    assert engine.kv_tiers.stats()["host"]["hits"] == 6


# ---- a slow tier costs only the request that asked ------------------------------------------------
SHORT_PROMPT = [300, 301, 302]  # no full page: nothing to look up in any tier


@pytest.fixture
def dripping_store(monkeypatch: pytest.MonkeyPatch):
    """A shared tier whose store answers every GET one byte at a time (for up to a minute)."""
    from densa.auth.secret import SECRET_ENV, ClusterSecret
    from densa_bench.common.drip_store import DripStore

    monkeypatch.setenv(SECRET_ENV, ClusterSecret.generate().value.decode())
    with DripStore(drip_interval_s=0.05, max_drip_s=60) as store:
        yield store


def run_until(engine: LLMEngine, collector: Collector, request_id: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while request_id not in collector.finals:
        assert time.monotonic() < deadline, f"{request_id} not served within {limit_s} s"
        collector.add(engine.step())
        engine.check_invariants()


def test_a_dripping_store_never_delays_another_tenants_request(
    reference, make_engine, dripping_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tenant A's lookup waits on a GET the store drips (deadlines set far out, so only the
    engine's design keeps B from waiting): B's 3-token request, which needs nothing from the
    tier, is served while A's answer is still dripping, and A then computes its prefix."""
    from densa.cache.tiers import shared
    from densa.engine import kv_tiers

    monkeypatch.setattr(shared, "CALL_TIMEOUT_S", 120.0)
    monkeypatch.setattr(kv_tiers, "LOOKUP_DEADLINE_S", 120.0)
    engine = make_engine((f"shared:{dripping_store.url}",))
    collector = Collector()
    first = prompts(0)[0]
    a_id = engine.add_request(first, GREEDY, cache_scope="tenant-a")
    started = time.monotonic()
    collector.add(engine.step())  # A's lookup starts; with nothing running the step waits briefly
    assert time.monotonic() - started < 10  # (it used to wait for the lookup: the whole drip)
    assert a_id in engine.scheduler.fetching and dripping_store.num_dripping == 1
    b_id = engine.add_request(SHORT_PROMPT, GREEDY, cache_scope="tenant-b")
    run_until(engine, collector, b_id, limit_s=40)  # the drip lasts a minute
    assert a_id in engine.scheduler.fetching and dripping_store.num_dripping == 1  # still stalled
    assert engine.scheduler.requests[a_id].num_computed_tokens == 0
    dripping_store.stop_dripping()  # the store gives up on A's answer: A's lookup fails
    run_until(engine, collector, a_id, limit_s=120)
    assert collector.finals[a_id].num_cached_tokens == 0  # A lost its hits, nothing else
    assert collector.finals[a_id].token_ids == reference[1].token_ids
    assert len(collector.finals[b_id].token_ids) == GREEDY.max_tokens


def test_a_dripping_store_is_cut_at_the_calls_deadline(
    reference, make_engine, dripping_store
) -> None:
    """With the real deadline (CALL_TIMEOUT_S), A's lookup ends in a fraction of a second of
    the drip's minute: A computes its prefix, the timeout is counted, the store is skipped."""
    engine = make_engine((f"shared:{dripping_store.url}",))
    runner = Runner(engine)
    started = time.monotonic()
    final, computed = runner.run(prompts(0)[0])
    assert time.monotonic() - started < 45  # a prompt's compute, not the drip's 60 s
    assert final.num_cached_tokens == 0 and final.token_ids == reference[1].token_ids
    assert computed == reference[2]  # the whole prompt, as without tiers
    (stats,) = engine.kv_tiers.stats().values()
    assert stats["timeouts"] == 1 and stats["hits"] == 0


def test_a_lookup_stuck_inside_a_tier_call_is_given_up(
    tmp_path: Path, reference, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier call that never returns (a hung network file system, where no socket deadline
    applies): the engine stops holding the request at the lookup's deadline, and it computes."""
    import threading

    from densa.engine import kv_tiers

    monkeypatch.setattr(kv_tiers, "LOOKUP_DEADLINE_S", 0.3)
    monkeypatch.setattr(kv_tiers, "ABANDON_GRACE_S", 0.2)
    engine = make_engine((f"disk:{tmp_path}:64MiB",))
    tier = engine.kv_tiers.tiers[0]
    hung = threading.Event()
    monkeypatch.setattr(tier, "get", lambda key: hung.wait(60) and None)
    runner = Runner(engine)
    final, _ = runner.run(prompts(0)[0])
    assert final.num_cached_tokens == 0 and final.token_ids == reference[1].token_ids
    assert engine.kv_tiers.num_abandoned_lookups == 1
    assert engine.kv_tiers.stats()[tier.name]["abandoned_lookups"] == 1
    hung.set()  # let the reader thread go, so the tiers close


def test_while_every_reader_is_stuck_requests_do_not_wait_for_the_tier(
    tmp_path: Path, reference, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier hung for good holds every reader thread: a new lookup is not queued behind them
    (it would hold its request until its deadline passed unstarted), the request computes at
    once; and the engine still shuts down (the readers are daemon threads)."""
    import threading

    from densa.engine import kv_tiers

    monkeypatch.setattr(kv_tiers, "LOOKUP_DEADLINE_S", 60.0)
    engine = make_engine((f"disk:{tmp_path}:64MiB",))
    tiers = engine.kv_tiers
    hung = threading.Event()
    monkeypatch.setattr(tiers.tiers[0], "get", lambda key: hung.wait(60) and None)
    stuck = [tiers._reader.submit(hung.wait, 60) for _ in range(kv_tiers.MAX_READERS)]
    deadline = time.monotonic() + 10
    while tiers._reader.num_idle and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    final, _ = Runner(engine).run(prompts(0)[0])
    assert time.monotonic() - started < 30  # not held for the 60 s lookup deadline
    assert final.num_cached_tokens == 0 and final.token_ids == reference[1].token_ids
    assert (
        tiers.num_skipped_lookups == 1
        and tiers.stats()[tiers.tiers[0].name]["skipped_lookups"] == 1
    )
    hung.set()
    assert all(f.result(timeout=10) for f in stuck)


def test_a_reader_stuck_for_good_does_not_keep_the_process_from_exiting() -> None:
    import subprocess
    import sys

    code = ("import threading; from densa.utils.daemon_pool import DaemonPool; "
            "pool = DaemonPool(2, 't'); pool.submit(threading.Event().wait); pool.shutdown(); "
            "print('done')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr


def test_the_engine_refuses_a_disk_tier_others_may_use(tmp_path: Path) -> None:
    """Through build_tiers, as the engine starts: an error that says what to do, not a tier
    quietly turned off (no model needed)."""
    from densa.cache.tiers.tier import TierSetupError
    from densa.engine.kv_tier_setup import build_tiers

    directory = tmp_path / "kv"
    directory.mkdir()
    directory.chmod(0o755)
    with pytest.raises(TierSetupError, match=f"chmod 700 {directory}"):
        build_tiers(["host:1MiB", f"disk:{directory}:1MiB"], bytes(16), None)


def test_the_stores_password_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No model needed: the tiers build_tiers makes against a redis-server that requires a
    password, given as --kv-tier-password-file or DENSA_KV_TIER_PASSWORD (never in argv)."""
    from densa.auth.secret import SECRET_ENV, ClusterSecret
    from densa.engine.kv_tier_setup import STORE_PASSWORD_ENV, build_tiers
    from densa_bench.common.redis_server import INSTALL_HINT, RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip(INSTALL_HINT)
    monkeypatch.setenv(SECRET_ENV, ClusterSecret.generate().value.decode())
    password = "from-a-file-or-the-environment"
    password_file = tmp_path / "store-password"
    password_file.write_text(password + "\n")
    key, page = bytes(range(16)), b"p" * 1000
    with RedisServer(maxmemory="32mb", password=password) as server:
        spec = f"shared:redis://127.0.0.1:{server.port}/0"
        (by_file,) = build_tiers([spec], bytes(16), None, str(password_file))
        by_file.put(key, page)
        monkeypatch.setenv(STORE_PASSWORD_ENV, password)
        (by_env,) = build_tiers([spec], bytes(16), None)
        assert bytes(by_env.get(key) or b"") == page  # both authenticated: one store, one key
        monkeypatch.delenv(STORE_PASSWORD_ENV)
        (without,) = build_tiers([spec], bytes(16), None)
        assert without.get(key) is None  # NOAUTH: a miss, never an error
        with pytest.raises(ValueError, match="given twice"):
            build_tiers([f"shared:redis://:x@127.0.0.1:{server.port}/0"], bytes(16), None,
                        str(password_file))  # fmt: skip
        for tier in (by_file, by_env, without):
            tier.close()
