"""The Router over hand-made worker state: P/D pairs, sessions, ejection and backoff."""

from __future__ import annotations

from densa.router.incoming import Incoming
from densa.router.lengths import LengthEstimator
from densa.router.policy import WeightedPolicy, Weights
from densa.router.prefix import WorkerPrefixIndex, block_hashes
from densa.router.ring import HashRing
from densa.router.routing import Router
from densa.router.sessions import SessionTable
from densa.router.workers import HealthOptions, LoadReport, Worker, WorkerPool

P1, P2, D1, D2 = "http://p1:1", "http://p2:2", "http://d1:3", "http://d2:4"


def load(free: int = 100, running: int = 0, waiting: int = 0, pid: int = 1) -> LoadReport:
    return LoadReport(running, waiting, running + waiting, 100, free, 16, pid, 0.0)


def make_router(roles: dict[str, str], clock: list[float] | None = None) -> Router:
    now = clock or [0.0]
    workers = {url: Worker(url, role, WorkerPrefixIndex(1)) for url, role in roles.items()}
    pool = WorkerPool(workers, HealthOptions(), clock=lambda: now[0])
    for worker in workers.values():
        pool.report_ok(worker, load())
    targets = [u for u, r in roles.items() if r != "prefill"]
    router = Router(pool, WeightedPolicy(Weights()), SessionTable(), HashRing(targets),
                    LengthEstimator())  # fmt: skip
    pool.on_ejected = router.on_ejected
    return router


def incoming(tokens: list[int], session: str | None = None, scope: str = "") -> Incoming:
    return Incoming("/v1/chat/completions", b"{}", session, False, 32, tokens, scope)


class _Model:
    page_size = 16


def test_pd_pair_prefill_by_prefix_and_queue_decode_by_kv_and_length() -> None:
    router = make_router({P1: "prefill", P2: "prefill", D1: "decode", D2: "decode"})
    router.model = _Model()  # type: ignore[assignment]  # only the page size is read
    tokens = list(range(160))
    # P2 holds the prompt's blocks; P1 is idle. D1 has little free KV; D2 plenty.
    router.pool.workers[P2].prefix.insert(block_hashes(tokens, 16, ""))
    router.pool.report_ok(router.pool.workers[P2], load(running=1))
    router.pool.report_ok(router.pool.workers[D1], load(free=20))
    placement = router.place(incoming(tokens))
    assert placement is not None
    assert placement.worker.url == D2 and placement.prefill is not None
    assert placement.prefill.url == P2
    assert placement.decision.signal == "kv"
    # the prefill worker's queue counts: a busy P2 with the prefix loses to an idle P1
    router.pool.report_ok(router.pool.workers[P2], load(running=40))
    router.pool.workers[P1].prefix.insert(block_hashes(tokens, 16, "")[:5])
    again = router.place(incoming(tokens))
    assert again is not None and again.prefill is not None and again.prefill.url == P1


def test_pd_decode_keeps_a_sessions_worker_and_needs_a_prefill_worker() -> None:
    router = make_router({P1: "prefill", D1: "decode", D2: "decode"})
    first = router.place(incoming([1] * 40, session="s"))
    assert first is not None
    router.opened(first)
    router.closed(first, 5)
    other = D2 if first.worker.url == D1 else D1
    router.pool.report_ok(router.pool.workers[first.worker.url], load(free=60))
    second = router.place(incoming([1] * 40, session="s"))
    assert second is not None and second.worker.url == first.worker.url != other
    assert second.decision.signal == "affinity"
    router.pool.report_failure(router.pool.workers[P1], "down")
    assert router.place(incoming([1] * 40, session="s")) is None


def test_ejection_backs_off_exponentially_and_a_good_poll_readmits() -> None:
    now = [100.0]
    router = make_router({D1: "mixed", D2: "mixed"}, now)
    pool, worker = router.pool, router.pool.workers[D1]
    worker.prefix.insert(block_hashes(list(range(64)), 16, ""))
    router.sessions.stick("s", D1)
    delays = []
    for _ in range(8):
        pool.report_failure(worker, "refused")
        delays.append(worker.next_probe_at - now[0])
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert not worker.is_healthy and len(worker.prefix) == 0
    assert router.sessions.lookup("s") is None  # its session will be placed again
    assert [w.url for w in router.targets()] == [D2]
    pool.report_ok(worker, load())
    assert worker.is_healthy and worker.num_failures == 0 and len(router.targets()) == 2


def test_a_new_engine_life_clears_the_workers_prefix_index() -> None:
    router = make_router({D1: "mixed"})
    worker = router.pool.workers[D1]
    worker.prefix.insert(block_hashes(list(range(64)), 16, ""))
    router.pool.report_ok(worker, load(pid=1))
    assert len(worker.prefix) == 3
    router.pool.report_ok(worker, load(pid=2))
    assert len(worker.prefix) == 0


def test_open_requests_count_as_queue_and_expected_decode_work_until_closed() -> None:
    router = make_router({D1: "mixed", D2: "mixed"})
    first = router.place(incoming(list(range(40))))
    assert first is not None
    router.opened(first)
    assert first.worker.queue_depth == 1 and first.worker.pending_output_tokens == 32
    second = router.place(incoming(list(range(40))))
    assert second is not None and second.worker is not first.worker
    router.closed(first, 7)
    assert first.worker.num_open == 0 and first.worker.pending_output_tokens == 0
    assert router.lengths.mean("/v1/chat/completions") == 7
    excluded = router.place(incoming([1, 2, 3]), exclude=frozenset({D1, D2}))
    assert excluded is None


def test_a_new_session_avoids_the_worker_whose_sessions_are_between_turns() -> None:
    router = make_router({D1: "mixed", D2: "mixed"})
    for i in range(3):  # three conversations on D1, none of them in flight now
        turn = router.place(incoming(list(range(40)), session=f"old-{i}"))
        assert turn is not None
        turn.worker = router.pool.workers[D1]
        router.opened(turn)
        router.closed(turn, 5)
    assert router.pool.workers[D1].queue_depth == 0 and router.sessions.num_live(D1) == 3
    new = router.place(incoming(list(range(40)), session="new"))
    assert new is not None and new.worker.url == D2 and new.decision.signal == "queue"
    # D1's own sessions stay there; a request without a session sees two idle workers
    again = router.place(incoming(list(range(40)), session="old-0"))
    assert again is not None and again.worker.url == D1 and again.decision.signal == "affinity"
    assert router.place(incoming(list(range(40)))) is not None
