"""The router's decisions: one request -> a worker (or a prefill + decode pair), and the
bookkeeping around it (sessions, prefix index, expected lengths, open requests).

    place(incoming, exclude)   -> Placement | None    (None: no healthy worker left to try)
    opened(placement)             the request is on its way: count it, index its blocks
    closed(placement, n_output)   its response is over: uncount it, learn its length

With only --worker (co-located) workers, every healthy worker is a candidate and every weight
applies. With prefill and decode pools, the decode worker is chosen by free KV, expected length
and affinity (it holds the request the longest), and the prefill worker by prefix overlap and
queue (it does the prompt's compute); mixed workers, if any, compete with the decode pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from densa.cache.prefix_index import BlockHash
from densa.router.incoming import Incoming, ModelInfo
from densa.router.lengths import LengthEstimator
from densa.router.policy import Decision, RouteFeatures, RoutingPolicy, WeightedPolicy, WorkerView
from densa.router.prefix import SharedTierIndex, block_hashes
from densa.router.ring import HashRing
from densa.router.sessions import SessionTable
from densa.router.workers import Worker, WorkerPool

ONE_STORE = "all-workers"  # the store name --shared-kv-tier gives every worker

if TYPE_CHECKING:
    from densa.router.metrics import RouterMetrics

DECODE_SIGNALS = ("kv", "length", "affinity", "ring")
PREFILL_SIGNALS = ("prefix", "queue")


@dataclass
class Placement:
    worker: Worker  # the one the request is sent to (the decode worker in P/D mode)
    prefill: Worker | None  # P/D mode: the worker the decode worker pulls the prompt's KV from
    decision: Decision
    hashes: list[BlockHash]
    expected_output_tokens: int
    session_id: str | None
    route: str


@dataclass
class Router:
    pool: WorkerPool
    policy: RoutingPolicy
    sessions: SessionTable
    ring: HashRing
    lengths: LengthEstimator
    metrics: RouterMetrics | None = None
    model: ModelInfo | None = None
    # Blocks routed to a worker with a shared KV tier, which every worker of the same store can
    # fetch once their first holder frees them (None: each worker's device pool only).
    shared_tiers: SharedTierIndex | None = None
    # --shared-kv-tier: every worker reads one store, whatever it reports (workers that do not
    # report theirs); else each worker's store is the one its load reports name.
    assume_one_store: bool = False

    # ---- placing ------------------------------------------------------------------------------
    def place(self, incoming: Incoming, exclude: frozenset[str] = frozenset()) -> Placement | None:
        targets = [w for w in self.targets() if w.url not in exclude]
        if not targets:
            return None
        hashes = self._hashes(incoming)
        expected = self.lengths.expect(incoming.route, incoming.max_tokens)
        features = self._features(incoming, hashes, expected, targets)
        decision = self._policy_for(targets).choose(features, self._views(targets, hashes))
        worker = self.pool.workers[decision.url]
        prefill = None
        if worker.role == "decode":
            prefill = self._pick_prefill(incoming, features, hashes)
            if prefill is None:
                return None  # a decode worker cannot run the prompt alone
        return Placement(worker, prefill, decision, hashes, expected, incoming.session_id,
                         incoming.route)  # fmt: skip

    def targets(self) -> list[Worker]:
        """Where responses come from: mixed and decode workers (prefill workers only prefill)."""
        return [w for w in self.pool.healthy() if w.role != "prefill"]

    def _policy_for(self, targets: list[Worker]) -> RoutingPolicy:
        has_decode_pool = any(w.role == "decode" for w in targets)
        if has_decode_pool and isinstance(self.policy, WeightedPolicy):
            return WeightedPolicy(self.policy.weights.only(*DECODE_SIGNALS), "densa-decode")
        return self.policy

    def _pick_prefill(
        self, incoming: Incoming, features: RouteFeatures, hashes: list[BlockHash]
    ) -> Worker | None:
        candidates = self.pool.healthy("prefill")
        if not candidates:
            return None
        policy = self.policy
        if isinstance(policy, WeightedPolicy):
            policy = WeightedPolicy(policy.weights.only(*PREFILL_SIGNALS), "densa-prefill")
        decision = policy.choose(features, self._views(candidates, hashes))
        return self.pool.workers[decision.url]

    def _hashes(self, incoming: Incoming) -> list[BlockHash]:
        if incoming.prompt_ids is None or self.model is None:
            return []
        return block_hashes(incoming.prompt_ids, self.model.page_size, incoming.scope)

    def _features(
        self, incoming: Incoming, hashes: list[BlockHash], expected: int, targets: list[Worker]
    ) -> RouteFeatures:
        sticky = ring_home = None
        is_new_session = False
        if incoming.session_id is not None:
            sticky = self.sessions.lookup(incoming.session_id)
            if sticky not in {w.url for w in targets}:
                sticky = None
                ring_home = self.ring.owner(incoming.session_id, {w.url for w in targets})
                is_new_session = True
        num_tokens = len(incoming.prompt_ids) if incoming.prompt_ids is not None else 0
        return RouteFeatures(num_tokens, len(hashes), expected, sticky, ring_home, is_new_session)

    def _views(self, workers: list[Worker], hashes: list[BlockHash]) -> list[WorkerView]:
        views = []
        shared = self._shared_matches(workers, hashes)
        for w in workers:
            load = w.load
            total = load.num_kv_pages if load else 0
            views.append(WorkerView(
                url=w.url, queue_depth=w.queue_depth,
                num_free_kv_pages=load.num_free_kv_pages if load else 0, num_kv_pages=total,
                page_size=load.page_size if load else 1,
                pending_output_tokens=w.pending_output_tokens, num_routed=w.num_routed,
                matched_blocks=w.prefix.match(hashes),
                num_sessions=self.sessions.num_live(w.url), shared_blocks=shared[w.url],
            ))  # fmt: skip
        return views

    def store_of(self, worker: Worker) -> str | None:
        """The shared KV store `worker` reads and writes, as the router knows it (None: none)."""
        if self.assume_one_store:
            return ONE_STORE
        return worker.load.shared_kv_tier if worker.load is not None else None

    def _shared_matches(self, workers: list[Worker], hashes: list[BlockHash]) -> dict[str, int]:
        if self.shared_tiers is None:
            return {w.url: 0 for w in workers}
        return {w.url: self.shared_tiers.match(self.store_of(w), hashes) for w in workers}

    # ---- bookkeeping --------------------------------------------------------------------------
    def opened(self, placement: Placement) -> None:
        worker = placement.worker
        worker.num_open += 1
        worker.num_routed += 1
        worker.pending_output_tokens += placement.expected_output_tokens
        for holder in (worker, placement.prefill):
            if holder is not None:
                holder.prefix.insert(placement.hashes)
        if self.shared_tiers is not None:
            for holder in (worker, placement.prefill):
                if holder is not None:
                    self.shared_tiers.insert(self.store_of(holder), placement.hashes)
        if placement.session_id is not None:
            self.sessions.stick(placement.session_id, worker.url)
        if self.metrics is not None:
            self.metrics.decisions.labels(placement.decision.signal).inc()

    def closed(self, placement: Placement, num_output_tokens: int | None) -> None:
        worker = placement.worker
        worker.num_open -= 1
        worker.num_closed_since_poll += 1
        worker.pending_output_tokens -= placement.expected_output_tokens
        if num_output_tokens is not None:
            self.lengths.observe(placement.route, num_output_tokens)

    # ---- membership ---------------------------------------------------------------------------
    def on_ejected(self, url: str, reason: str) -> None:
        self.sessions.forget_worker(url)
        if self.metrics is not None:
            self.metrics.count_ejection(url, reason)
