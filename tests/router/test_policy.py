"""The routing policy, the ring, the prefix index and the session table as pure functions:
exact choices on hand-made snapshots."""

from __future__ import annotations

import pytest

from densa.cache.kv_manager import KVCacheManager
from densa.cache.scope import CacheScope
from densa.request import Request
from densa.router.lengths import LengthEstimator
from densa.router.policy import (
    Decision,
    RoundRobin,
    RouteFeatures,
    WeightedPolicy,
    Weights,
    WorkerView,
    make_policy,
    signal_values,
)
from densa.router.prefix import WorkerPrefixIndex, block_hashes
from densa.router.ring import HashRing
from densa.router.sessions import SessionTable
from densa.sampling_params import SamplingParams

A, B, C = "http://a:1", "http://b:2", "http://c:3"


def view(url: str, **overrides: int) -> WorkerView:
    settings = {"queue_depth": 0, "num_free_kv_pages": 100, "num_kv_pages": 100, "page_size": 16,
                "pending_output_tokens": 0, "num_routed": 0, "matched_blocks": 0}  # fmt: skip
    settings.update(overrides)
    return WorkerView(url=url, **settings)


DENSA = WeightedPolicy(Weights())


# ---- the weighted score --------------------------------------------------------------------------
def test_a_live_session_stays_on_its_worker_even_against_a_full_prefix_elsewhere() -> None:
    features = RouteFeatures(160, 10, 16, sticky_url=B)
    decision = DENSA.choose(features, [view(A, matched_blocks=10), view(B), view(C)])
    assert decision.url == B and decision.signal == "affinity"


def test_a_new_sessions_prefix_beats_its_ring_home() -> None:
    features = RouteFeatures(160, 10, 16, ring_url=C)
    decision = DENSA.choose(features, [view(A, matched_blocks=9), view(B), view(C)])
    assert decision.url == A and decision.signal == "prefix"
    # 3 * 0.9 + kv vs ring 1: a one-block overlap (0.1 * 3 = 0.3) does not beat the ring home
    small = DENSA.choose(features, [view(A, matched_blocks=1), view(B), view(C)])
    assert small.url == C and small.signal == "ring"


def test_among_idle_equal_workers_the_ring_home_wins() -> None:
    decision = DENSA.choose(RouteFeatures(40, 2, 16, ring_url=B), [view(A), view(B), view(C)])
    assert decision.url == B and decision.signal == "ring"


def test_queue_depth_decides_without_session_or_prefix() -> None:
    views = [view(A, queue_depth=4), view(B, queue_depth=1), view(C, queue_depth=2)]
    decision = DENSA.choose(RouteFeatures(40, 2, 16), views)
    assert decision.url == B and decision.signal == "queue"
    values = signal_values(RouteFeatures(40, 2, 16), views)
    # min-max over the candidates: (4 - q) / (4 - 1)
    assert [values[u]["queue"] for u in (A, B, C)] == pytest.approx([0.0, 1.0, 2 / 3])


def test_queue_and_length_are_min_max_normalized_and_equal_loads_score_one() -> None:
    busy = [view(A, queue_depth=5, pending_output_tokens=300),
            view(B, queue_depth=5, pending_output_tokens=300)]  # fmt: skip
    values = signal_values(RouteFeatures(40, 2, 16), busy)
    assert all(values[u]["queue"] == values[u]["length"] == 1.0 for u in (A, B))
    # one request of difference between two busy workers is a full queue lead, as between an
    # idle and a busy one (normalized by the max alone, 5 vs 6 would score only 1/6)
    values = signal_values(
        RouteFeatures(40, 2, 16), [view(A, queue_depth=6), view(B, queue_depth=5)]
    )
    assert values[A]["queue"] == 0.0 and values[B]["queue"] == 1.0


def test_a_new_session_goes_to_a_less_busy_worker_rather_than_pile_onto_the_prompt_holders() -> (
    None
):
    # A and C hold the tenant's system prompt (13 of the prompt's 22 blocks) and run 3 sessions'
    # requests each (24 output tokens expected per request); B holds nothing and runs 2. The
    # prefix, 3 * 13/22 = 1.77 (and B's extra 13 pages of KV), loses to B's queue and length
    # leads of 2 + 1; normalized by the max alone they were worth 2 * 1/3 + 1 * 1/4, and the
    # session piled onto a prompt holder.
    def worker(url: str, queue: int, matched: int = 0) -> WorkerView:
        return view(url, queue_depth=queue, pending_output_tokens=24 * queue,
                    num_kv_pages=182, num_free_kv_pages=182, matched_blocks=matched)  # fmt: skip

    features = RouteFeatures(365, 22, 24)
    decision = DENSA.choose(features, [worker(A, 3, 13), worker(B, 2), worker(C, 3, 13)])
    assert decision.url == B and decision.signal == "queue"
    # with equal queues, the prompt holders win on the prefix
    even = DENSA.choose(features, [worker(A, 3, 13), worker(B, 3), worker(C, 3, 13)])
    assert even.url == A and even.scores[A] == even.scores[C] > even.scores[B]


def test_a_new_session_counts_a_workers_live_sessions_as_its_load() -> None:
    # A's three conversations are between turns (nothing in flight this instant); B runs one
    # request of its one session. A new session will share A with three conversations: B.
    views = [view(A, queue_depth=0, num_sessions=3), view(B, queue_depth=1, num_sessions=1)]
    new_session = DENSA.choose(RouteFeatures(40, 2, 16, ring_url=A, is_new_session=True), views)
    assert new_session.url == B and new_session.signal == "queue"
    # a request without a session only waits behind what is in flight: A
    assert DENSA.choose(RouteFeatures(40, 2, 16), views).url == A
    # in-flight requests are their sessions' turns: the larger count is the load, not the sum
    values = signal_values(
        RouteFeatures(40, 2, 16, is_new_session=True),
        [view(A, queue_depth=2, num_sessions=2), view(B, queue_depth=0, num_sessions=2)],
    )
    assert values[A]["queue"] == values[B]["queue"] == 1.0


def test_a_long_shared_prompt_draws_a_new_session_past_its_ring_home_and_one_more_session() -> None:
    # A holds 19 of the prompt's 20 blocks (a tenant's long system prompt) and one live session;
    # B, the new session's ring home, has none. 3 * 19/20 = 2.85 of prefix beats B's queue lead
    # of 2 plus its ring home's 0.5 (at the ring's old weight of 1 it lost).
    big = {"num_kv_pages": 1000, "num_free_kv_pages": 1000}  # free KV hardly differs
    views = [view(A, num_sessions=1, matched_blocks=19, **big), view(B, **big)]
    decision = DENSA.choose(RouteFeatures(330, 20, 16, ring_url=B, is_new_session=True), views)
    assert decision.url == A and decision.signal == "prefix"
    old_ring = WeightedPolicy(Weights(ring=1.0))
    assert (
        old_ring.choose(RouteFeatures(330, 20, 16, ring_url=B, is_new_session=True), views).url == B
    )


def test_free_kv_after_the_request_decides_between_equal_queues() -> None:
    views = [view(A, num_free_kv_pages=10), view(B, num_free_kv_pages=60)]
    decision = DENSA.choose(RouteFeatures(64, 4, 64), views)
    assert decision.url == B and decision.signal == "kv"
    # 64 prompt + 64 expected output tokens = 8 pages of 16: (60 - 8) / 100 free afterwards
    assert signal_values(RouteFeatures(64, 4, 64), views)[B]["kv"] == pytest.approx(0.52)


def test_cached_blocks_reduce_the_kv_the_request_needs() -> None:
    features = RouteFeatures(64, 4, 0)
    values = signal_values(features, [view(A, num_free_kv_pages=10, matched_blocks=3)])
    assert values[A]["kv"] == pytest.approx((10 - 1) / 100)  # only the 4th block is new


def test_expected_decode_work_decides_between_otherwise_equal_workers() -> None:
    views = [view(A, pending_output_tokens=900), view(B, pending_output_tokens=100)]
    decision = WeightedPolicy(Weights().only("length")).choose(RouteFeatures(16, 1, 100), views)
    assert decision.url == B and decision.signal == "length"
    values = signal_values(RouteFeatures(16, 1, 100), views)
    assert values[A]["length"] == 0.0 and values[B]["length"] == 1.0
    three = [*views, view(C, pending_output_tokens=500)]
    assert signal_values(RouteFeatures(16, 1, 100), three)[C]["length"] == pytest.approx(0.5)


def test_ties_go_to_the_least_routed_then_the_first_listed() -> None:
    views = [view(A, num_routed=3), view(B, num_routed=1), view(C, num_routed=1)]
    decision = DENSA.choose(RouteFeatures(), views)
    assert decision.url == B and decision.signal == "tie"
    assert DENSA.choose(RouteFeatures(), [view(A)]).signal == "only"


def test_round_robin_cycles_and_single_signal_policies_ignore_other_signals() -> None:
    rr = RoundRobin()
    views = [view(A), view(B), view(C)]
    assert [rr.choose(RouteFeatures(), views).url for _ in range(4)] == [A, B, C, A]
    prefix_only = make_policy("prefix", Weights())
    loaded = [view(A, queue_depth=50, matched_blocks=2), view(B)]
    assert prefix_only.choose(RouteFeatures(64, 4, 16, sticky_url=B), loaded).url == A
    least = make_policy("least-load", Weights())
    assert least.choose(RouteFeatures(64, 4, 16), loaded).url == B
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", Weights())
    with pytest.raises(ValueError, match="must be >= 0"):
        Weights(prefix=-1)


# ---- block hashes: the workers' own chain, scoped by tenant ------------------------------------
def test_router_block_hashes_are_exactly_the_hashes_a_worker_caches() -> None:
    scope = CacheScope(tenant="t1").digest()
    tokens = list(range(1000, 1045))  # 2 full blocks of 16, then 13 tokens
    kv = KVCacheManager(num_pages=16, page_size=16)
    request = Request("r", tokens, SamplingParams(), cache_scope=scope)
    kv.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.cache_full_pages(request)
    worker_hashes = kv._hashes(request)
    assert block_hashes(tokens, 16, scope) == worker_hashes[:2]
    # A follow-up that the worker finds 2 cached blocks for, the router finds too.
    follow_up = Request("s", [*tokens[:32], 7, 7, 7], SamplingParams(), cache_scope=scope)
    index = WorkerPrefixIndex(16)
    index.insert(block_hashes(tokens, 16, scope))
    assert len(kv.find_prefix(follow_up).page_ids) == 2
    assert index.match(block_hashes(follow_up.prompt_token_ids, 16, scope)) == 2


def test_another_tenants_identical_prompt_matches_nothing() -> None:
    tokens = list(range(200))
    index = WorkerPrefixIndex(64)
    index.insert(block_hashes(tokens, 16, CacheScope(tenant="a").digest()))
    assert index.match(block_hashes(tokens, 16, CacheScope(tenant="a").digest())) == 12
    for other in (CacheScope(tenant="b"), CacheScope(tenant="a", user="u"), CacheScope()):
        assert index.match(block_hashes(tokens, 16, other.digest())) == 0


def test_the_last_token_block_is_never_counted_and_the_index_is_lru_bounded() -> None:
    assert len(block_hashes(list(range(32)), 16, "")) == 1  # token 32 would need the 2nd block
    assert len(block_hashes(list(range(33)), 16, "")) == 2
    index = WorkerPrefixIndex(capacity=3)
    first, second = block_hashes(list(range(64)), 16, "x"), block_hashes(list(range(64)), 16, "y")
    index.insert(first)  # 3 blocks
    index.insert(second[:1])  # evicts first[0]
    assert len(index) == 3 and index.match(first) == 0 and index.match(second) == 1


# ---- the ring ------------------------------------------------------------------------------------
def test_adding_a_worker_moves_about_one_in_n_keys_all_to_the_new_worker() -> None:
    keys = [f"session-{i}" for i in range(3000)]
    ring = HashRing([A, B, C])
    before = {k: ring.owner(k) for k in keys}
    ring.add("http://d:4")
    after = {k: ring.owner(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert {after[k] for k in moved} == {"http://d:4"}
    assert 0.15 < len(moved) / len(keys) < 0.35  # ~1/4
    ring.remove("http://d:4")
    assert {k: ring.owner(k) for k in keys} == before


def test_ring_spreads_keys_evenly_and_skips_members_not_allowed() -> None:
    ring = HashRing([A, B, C])
    counts = {m: 0 for m in (A, B, C)}
    for i in range(3000):
        owner = ring.owner(f"k{i}")
        assert owner is not None
        counts[owner] += 1
    assert all(700 < n < 1300 for n in counts.values()), counts
    key = next(f"k{i}" for i in range(100) if ring.owner(f"k{i}") == A)
    assert ring.owner(key, {B, C}) in {B, C}
    assert ring.owner(key, set()) is None and HashRing().owner(key) is None


# ---- sessions and lengths ------------------------------------------------------------------------
def test_sessions_stick_for_their_ttl_after_the_last_request() -> None:
    now = [0.0]
    table = SessionTable(ttl_s=10, clock=lambda: now[0])
    table.stick("s", A)
    now[0] = 9.0
    assert table.lookup("s") == A
    table.stick("s", A)  # a new turn renews the TTL
    now[0] = 18.0
    assert table.lookup("s") == A
    now[0] = 19.5
    assert table.lookup("s") is None and len(table) == 0
    table.stick("x", B)
    table.stick("y", B)
    table.stick("z", C)
    assert table.forget_worker(B) == 2 and table.lookup("z") == C


def test_sessions_are_counted_per_worker_while_live() -> None:
    now = [0.0]
    table = SessionTable(ttl_s=10, clock=lambda: now[0])
    for sid, url in (("s1", A), ("s2", A), ("s3", B)):
        table.stick(sid, url)
    assert (table.num_live(A), table.num_live(B), table.num_live(C)) == (2, 1, 0)
    now[0] = 5.0
    table.stick("s1", A)  # another turn: still one session, renewed
    table.stick("s3", C)  # moved (its worker was worse off): counted where it lives now
    assert (table.num_live(A), table.num_live(B), table.num_live(C)) == (2, 0, 1)
    now[0] = 12.0  # s2 expired (last seen at 0), s1 and s3 live until 15
    assert (table.num_live(A), table.num_live(C), len(table)) == (1, 1, 2)
    assert table.lookup("s2") is None
    table.forget_worker(A)
    assert table.num_live(A) == 0 and table.num_live(C) == 1
    bounded = SessionTable(max_sessions=2)
    for sid in ("a", "b", "c"):
        bounded.stick(sid, A)
    assert bounded.num_live(A) == 2 and bounded.lookup("a") is None


def test_expected_length_is_max_tokens_then_the_learned_mean_capped_by_it() -> None:
    lengths = LengthEstimator(default_tokens=256)
    assert lengths.expect("chat", None) == 256 and lengths.expect("chat", 40) == 40
    lengths.observe("chat", 20)
    assert lengths.expect("chat", None) == 20 and lengths.expect("chat", 10) == 10
    lengths.observe("chat", 120)  # moving average: 20 + 0.1 * 100
    assert lengths.expect("chat", None) == 30 and lengths.expect("completions", None) == 256


# ---- a shared KV tier ----------------------------------------------------------------------------
def test_a_shared_tier_hit_scores_below_a_device_hit_and_above_nothing() -> None:
    features = RouteFeatures(160, 10, 0)
    values = signal_values(features, [
        view(A, matched_blocks=10, shared_blocks=10),
        view(B, matched_blocks=4, shared_blocks=10),
        view(C, matched_blocks=0, shared_blocks=0),
    ])  # fmt: skip
    assert [values[u]["prefix"] for u in (A, B, C)] == [1.0, pytest.approx(0.7), 0.0]
    assert DENSA.choose(features, [view(B, matched_blocks=4, shared_blocks=10),
                                   view(A, matched_blocks=10, shared_blocks=10)]).url == A  # fmt: skip


def test_with_a_shared_tier_load_moves_a_session_that_a_device_hit_alone_would_keep() -> None:
    """The device holder is busy: without the shared tier the prefix pins the request there;
    with it the other worker can fetch the history, so the queue decides."""
    features = RouteFeatures(160, 10, 0)
    busy, idle = dict(matched_blocks=10, queue_depth=3), dict(queue_depth=0)
    local_only = DENSA.choose(features, [view(A, **busy), view(B, **idle)])
    shared = DENSA.choose(features, [view(A, **busy, shared_blocks=10),
                                     view(B, **idle, shared_blocks=10)])  # fmt: skip
    assert (local_only.url, local_only.signal) == (A, "prefix")
    assert (shared.url, shared.signal) == (B, "queue")


def _router_with_stores(stores: dict[str, str | None], assume_one_store: bool = False):
    """A round-robin router over workers that reported these shared stores (None: none)."""
    from densa.router.prefix import SharedTierIndex
    from densa.router.routing import Router
    from densa.router.workers import LoadReport, Worker, WorkerPool

    workers = {u: Worker(u, "mixed", WorkerPrefixIndex(100)) for u in stores}
    for url, store in stores.items():
        report = {"num_running": 0, "num_waiting": 0, "num_in_flight": 0, "num_kv_pages": 100,
                  "num_free_kv_pages": 100, "page_size": 16, "engine_pid": 1,
                  "shared_kv_tier": store}  # fmt: skip
        workers[url].load = LoadReport.from_json(report, 0.0)
    router = Router(WorkerPool(workers), RoundRobin(), SessionTable(), HashRing(list(stores)),
                    LengthEstimator(16), shared_tiers=SharedTierIndex(1000),
                    assume_one_store=assume_one_store)  # fmt: skip
    return router, workers


def test_the_router_counts_a_prefix_routed_anywhere_as_fetchable_by_all() -> None:
    """--shared-kv-tier: one store for all, whatever the workers report."""
    router, workers = _router_with_stores({A: None, B: None}, assume_one_store=True)
    hashes = block_hashes(list(range(1, 100)), 16, CacheScope(tenant="t").digest())
    views = {v.url: v for v in router._views([workers[A], workers[B]], hashes)}
    assert (views[A].shared_blocks, views[B].shared_blocks) == (0, 0)
    workers[A].prefix.insert(hashes)
    router.shared_tiers.insert(router.store_of(workers[A]), hashes)  # what opened() does
    views = {v.url: v for v in router._views([workers[A], workers[B]], hashes)}
    assert (views[A].matched_blocks, views[B].matched_blocks) == (6, 0)
    assert (views[A].shared_blocks, views[B].shared_blocks) == (6, 6)
    other = block_hashes(list(range(1, 100)), 16, CacheScope(tenant="u").digest())
    assert router.shared_tiers.match(router.store_of(workers[B]), other) == 0  # another tenant


def test_the_router_learns_each_workers_store_from_its_load_reports() -> None:
    """A and B report one store, C another, D none (and E a malformed id: none): a prefix
    routed to A is fetchable by B only."""
    from densa.router.routing import Placement

    C, D, E = "http://c:8000", "http://d:8000", "http://e:8000"
    stores = {A: "00aa11bb22cc33dd", B: "00aa11bb22cc33dd", C: "ffee00ddccbbaa99", D: None,
              E: "not an id; <script>"}  # fmt: skip
    router, workers = _router_with_stores(stores)
    assert router.store_of(workers[E]) is None
    hashes = block_hashes(list(range(1, 100)), 16, CacheScope(tenant="t").digest())
    decision = Decision(A, "prefix", {})
    router.opened(Placement(workers[A], None, decision, hashes, 8, None, "chat"))
    views = {v.url: v.shared_blocks for v in router._views(list(workers.values()), hashes)}
    assert views == {A: 6, B: 6, C: 0, D: 0, E: 0}
