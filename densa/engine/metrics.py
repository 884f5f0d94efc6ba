"""Engine gauges and lifetime counters as one plain snapshot (ipc.EngineStats), for /metrics and
benchmarks. The engine core takes one after every step and sends it with the step's outputs, so
nobody else ever walks the scheduler's or the page pool's structures."""

from __future__ import annotations

from densa.cache.integrity import ViolationKind
from densa.engine.llm_engine import LLMEngine
from densa.ipc.messages import EngineStats


def snapshot(engine: LLMEngine, num_steps: int = 0) -> EngineStats:
    """Read the engine's counters. Call it on the thread that runs the engine."""
    scheduler, kv = engine.scheduler, engine.kv_manager
    requests = list(scheduler.requests.values())
    counts = engine.integrity_stats.counts
    spec = engine.speculator
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
        kv_tiers=engine.kv_tiers.stats() if engine.kv_tiers is not None else {},
        shared_kv_tier=engine.kv_tiers.shared_store_id if engine.kv_tiers is not None else "",
        num_spec_proposed_tokens=spec.num_proposed_tokens if spec else 0,
        num_spec_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        num_spec_paused_steps=spec.num_paused_steps if spec else 0,
    )
