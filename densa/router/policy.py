"""Routing policies: which worker gets a request, and which signal decided it.

densa's policy is one weighted sum of five signals (docs/routing.md), each in [0, 1], higher is
better; the highest score wins:

    score(w) = W_affinity * A + W_ring * R + W_prefix * P + W_kv * K + W_queue * Q + W_length * L

    A  1 if the request's session (x-session-affinity) is stuck to w and its TTL has not run out
    R  1 if w owns a new session on the consistent-hash ring (sessions spread, and a new router
       or a new worker moves few of them); 0 for requests without a session
    P  (matched + SHARED_TIER_CREDIT * fetchable) / total: the prompt's full blocks that w
       probably caches, in the request's scope, plus those beyond them that any worker can
       fetch from the shared KV tier (--shared-kv-tier; a fetch skips the compute but still
       moves the bytes, so it counts less than a device hit)
    K  w's free KV pages after this request's uncached prompt and expected output, / total pages
    Q  (q_max - q) / (q_max - q_min) over candidates (1 if all equal), q = requests queued or
       running on w; for a new session, q = max(that, live sessions stuck to w)
    L  the same for d = w's expected decode tokens still to come (its requests' expected lengths)

Policies are pure functions of immutable snapshots (`WorkerView`, `RouteFeatures`), so tests pin
their exact choices. Ties go to the worker routed to least so far, then to the first listed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

SIGNALS = ("affinity", "ring", "prefix", "kv", "queue", "length")
# What a block fetchable from the shared KV tier is worth next to one in a worker's device pool.
SHARED_TIER_CREDIT = 0.5


@dataclass(frozen=True)
class Weights:
    """Weights of the signals; the defaults are argued in docs/routing.md."""

    affinity: float = 8.0  # a live session stays put unless its worker is badly worse off
    ring: float = 0.5  # a new session's home among equals; a real prefix or load decides first
    prefix: float = 3.0  # cached blocks save prefill compute (llm-d's default ratio 3:2:2)
    kv: float = 2.0
    queue: float = 2.0
    length: float = 1.0  # expected decode work already committed to the worker

    def only(self, *names: str) -> Weights:
        """These weights for `names`, zero for every other signal."""
        unknown = set(names) - set(SIGNALS)
        if unknown:
            raise ValueError(f"unknown signals {sorted(unknown)}; known: {SIGNALS}")
        return replace(self, **{n: 0.0 for n in SIGNALS if n not in names})

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"the weight of {f.name} must be >= 0")


@dataclass(frozen=True)
class WorkerView:
    """What a policy sees of one healthy worker, for one request."""

    url: str
    queue_depth: int  # requests running or waiting there (polled, or routed by us if more)
    num_free_kv_pages: int
    num_kv_pages: int
    page_size: int
    pending_output_tokens: int  # expected output tokens of our requests still open there
    num_routed: int = 0  # requests routed there so far (tie-break)
    matched_blocks: int = 0  # leading prompt blocks it probably caches (this request's scope)
    num_sessions: int = 0  # live sessions stuck to it
    # Leading prompt blocks any worker can fetch from the shared KV tier (the same for every
    # worker; 0 without --shared-kv-tier). Those beyond matched_blocks earn SHARED_TIER_CREDIT.
    shared_blocks: int = 0


@dataclass(frozen=True)
class RouteFeatures:
    """What a policy sees of the request."""

    num_prompt_tokens: int = 0
    num_blocks: int = 0  # full prompt blocks that could be cached
    expected_output_tokens: int = 0
    sticky_url: str | None = None  # the session's worker, if it has a live one
    ring_url: str | None = None  # a new session's ring home
    is_new_session: bool = False  # it names a session that has no live worker yet


@dataclass(frozen=True)
class Decision:
    url: str
    signal: str  # the signal that separated the winner from the runner-up ("tie", "only")
    scores: dict[str, float]  # url -> score (empty for policies that do not score)


def signal_values(
    features: RouteFeatures, views: Sequence[WorkerView]
) -> dict[str, dict[str, float]]:
    """url -> signal -> value in [0, 1] (the table the weighted sum is taken over)."""
    queue = _min_max_scores({v.url: _queue_load(features, v) for v in views})
    # This request's own expected output is the same on every worker, so only theirs compare.
    length = _min_max_scores({v.url: v.pending_output_tokens for v in views})
    table = {}
    for view in views:
        table[view.url] = {
            "affinity": float(view.url == features.sticky_url),
            "ring": float(view.url == features.ring_url),
            "prefix": _prefix_score(features, view),
            "kv": _free_after(features, view),
            "queue": queue[view.url],
            "length": length[view.url],
        }
    return table


def _prefix_score(features: RouteFeatures, view: WorkerView) -> float:
    if not features.num_blocks:
        return 0.0
    fetchable = max(view.shared_blocks - view.matched_blocks, 0)
    return (view.matched_blocks + SHARED_TIER_CREDIT * fetchable) / features.num_blocks


def _queue_load(features: RouteFeatures, view: WorkerView) -> int:
    """What the request will queue behind on w. A new session will come back turn after turn:
    it shares w with w's live sessions, not only with the requests in flight this instant (a
    session between two turns has none in flight, and a snapshot taken then would call a worker
    with three conversations idle). Its in-flight requests are its sessions' turns, so the two
    counts overlap: the larger one is the load."""
    if features.is_new_session:
        return max(view.queue_depth, view.num_sessions)
    return view.queue_depth


def _min_max_scores(loads: dict[str, int]) -> dict[str, float]:
    """(max - load) / (max - min): 1 for the least loaded candidate, 0 for the busiest, 1 for
    all when they are equal (llm-d's queue scorer). Normalizing by max alone would score queues
    of 2 and 3 as 0.33 and 0: one request of difference would count a third as much as between
    an idle and a busy worker, and a shared system prompt would pile sessions onto busy ones."""
    most, least = max(loads.values()), min(loads.values())
    if most == least:
        return dict.fromkeys(loads, 1.0)
    return {url: (most - load) / (most - least) for url, load in loads.items()}


def _free_after(features: RouteFeatures, view: WorkerView) -> float:
    """Share of w's pool still free once this request holds its uncached prompt and the output
    it is expected to write (the expected length weighs here as future KV load)."""
    if view.num_kv_pages <= 0:
        return 0.0
    cached_tokens = view.matched_blocks * view.page_size
    new_tokens = features.num_prompt_tokens - cached_tokens + features.expected_output_tokens
    need = -(-max(new_tokens, 0) // max(view.page_size, 1))
    return min(max((view.num_free_kv_pages - need) / view.num_kv_pages, 0.0), 1.0)


class RoutingPolicy(Protocol):
    """Picks one of `views` (non-empty, healthy workers). May keep private state (a cursor);
    never mutates the views."""

    name: str

    def choose(self, features: RouteFeatures, views: Sequence[WorkerView]) -> Decision: ...


@dataclass
class WeightedPolicy:
    """The weighted sum above. A single-signal policy is the same sum with one weight."""

    weights: Weights
    name: str = "densa"

    def choose(self, features: RouteFeatures, views: Sequence[WorkerView]) -> Decision:
        table = signal_values(features, views)
        scores = {url: self._score(values) for url, values in table.items()}
        order = {v.url: i for i, v in enumerate(views)}
        routed = {v.url: v.num_routed for v in views}
        ranked = sorted(scores, key=lambda u: (-scores[u], routed[u], order[u]))
        winner = ranked[0]
        if len(ranked) == 1:
            return Decision(winner, "only", scores)
        return Decision(winner, self._decider(table[winner], table[ranked[1]]), scores)

    def _score(self, values: dict[str, float]) -> float:
        return sum(getattr(self.weights, s) * values[s] for s in SIGNALS)

    def _decider(self, winner: dict[str, float], runner_up: dict[str, float]) -> str:
        """The signal whose weighted lead over the runner-up is largest ("tie" if none leads)."""
        leads = {s: getattr(self.weights, s) * (winner[s] - runner_up[s]) for s in SIGNALS}
        best = max(SIGNALS, key=lambda s: leads[s])
        return best if leads[best] > 1e-12 else "tie"


@dataclass
class RoundRobin:
    """Each request to the next worker in order (a baseline)."""

    name: str = "round-robin"
    _counter: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    def choose(self, features: RouteFeatures, views: Sequence[WorkerView]) -> Decision:
        view = views[next(self._counter) % len(views)]
        return Decision(view.url, "round-robin", {})


# Policy name -> factory(weights). "densa" uses every weight; the others are the baselines the
# benchmark compares against (one signal each, so the flags' weights do not apply to them).
POLICIES: dict[str, Callable[[Weights], RoutingPolicy]] = {
    "densa": lambda w: WeightedPolicy(w, "densa"),
    "prefix": lambda w: WeightedPolicy(Weights().only("prefix"), "prefix"),
    "least-load": lambda w: WeightedPolicy(Weights().only("queue"), "least-load"),
    "round-robin": lambda w: RoundRobin(),
}


def make_policy(name: str, weights: Weights) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](weights)
