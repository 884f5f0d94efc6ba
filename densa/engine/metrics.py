"""Engine gauges and lifetime counters as one plain snapshot, for /metrics and benchmarks.

The engine thread takes a snapshot after every step (see AsyncEngine), so readers on other threads
never walk the scheduler's or the page pool's structures while the engine mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.cache.integrity import ViolationKind
from densa.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineStats:
    """What the engine looks like right now, plus totals since it started."""

    num_running: int = 0  # requests holding pages and scheduled every step
    num_waiting: int = 0  # queued or preempted requests (no pages)
    num_session_requests: int = 0  # running + waiting requests that carry x-session-affinity
    num_kv_pages: int = 0
    num_free_kv_pages: int = 0  # includes free pages still holding a reusable cached prefix
    num_cached_kv_pages: int = 0  # pages indexed by the prefix cache (owned or free)
    page_size: int = 0
    # Tokens whose K/V the running requests hold; a prefix shared by n requests counts n times.
    num_resident_tokens: int = 0
    # Lifetime totals.
    num_steps: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0  # sampled by the engine, including any nobody received
    num_prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # ... of which were found there
    integrity_violations: dict[str, int] = field(default_factory=dict)  # by ViolationKind value

    @property
    def num_used_kv_pages(self) -> int:
        return self.num_kv_pages - self.num_free_kv_pages

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache (0 before any lookup)."""
        if not self.num_prefix_queried_tokens:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens


def snapshot(engine: LLMEngine, num_steps: int = 0) -> EngineStats:
    """Read the engine's counters. Call it on the thread that runs the engine."""
    scheduler, kv = engine.scheduler, engine.kv_manager
    requests = list(scheduler.requests.values())
    counts = engine.integrity_stats.counts
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_session_requests=sum(1 for r in requests if r.session_id is not None),
        num_kv_pages=kv.num_pages,
        num_free_kv_pages=kv.num_free_pages,
        num_cached_kv_pages=kv.num_cached_pages,
        page_size=kv.page_size,
        num_resident_tokens=sum(r.num_computed_tokens for r in scheduler.running),
        num_steps=num_steps,
        num_preemptions=scheduler.num_preemptions,
        num_generated_tokens=scheduler.num_generated_tokens,
        num_prefix_queried_tokens=kv.num_queried_tokens,
        num_prefix_hit_tokens=kv.num_hit_tokens,
        integrity_violations={kind.value: counts[kind] for kind in ViolationKind},
    )
