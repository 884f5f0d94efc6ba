"""Remote requests in the scheduler, exactly (no torch, no runner): receiving, reserved pages and
tags, a landing queued for the next step and applied after it, held pages, and what an end at
each stage frees."""

from __future__ import annotations

from densa.cache.integrity import ViolationKind
from densa.cache.kv_manager import KVCacheManager
from densa.config import SchedulerConfig
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.output import KVLanding, PackedPages
from densa.sched.scheduler import Scheduler

PAGES = PackedPages("float32", "none", (1, 2, 3, 1, 4, 8), memoryview(b""))  # opaque here


def make_scheduler(num_pages: int = 8, max_seqs: int = 8, prefix: bool = False) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=16, max_model_len=64, eos_token_ids=(2,)
    )
    return Scheduler(config, KVCacheManager(num_pages, 4, enable_prefix_caching=prefix))


def remote(
    scheduler: Scheduler, rid: str = "r", num_prompt: int = 10, max_tokens: int = 3
) -> Request:
    request = Request(rid, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=max_tokens))
    scheduler.kv.precompute(request)
    scheduler.add_remote(request)
    return request


def landing_of(scheduler: Scheduler, rid: str = "r", first_token: int = 7) -> KVLanding:
    reserved = scheduler.reserve_remote(rid)
    assert reserved is not None
    return KVLanding(rid, reserved.dest_page_ids, reserved.dest_tags, PAGES, first_token)


def check_pool(scheduler: Scheduler) -> None:
    owners = {rid: r.page_ids for rid, r in scheduler.requests.items()}
    owners.update({f"held:{rid}": pages for rid, (pages, _) in scheduler.held.items()})
    scheduler.kv.pool.check_consistency(owners)


def test_a_receiving_request_is_tracked_not_scheduled_until_its_landing() -> None:
    scheduler = make_scheduler()
    request = remote(scheduler)
    assert scheduler.is_receiving("r") and not scheduler.has_schedulable
    reserved = scheduler.reserve_remote("r")
    assert reserved is not None and reserved.first_block == 0
    assert reserved.dest_page_ids == [0, 1, 2] and reserved.dest_tags == [8, 9, 10]
    assert request.hold_pages  # a peer may write into them from now on
    out = scheduler.schedule()
    assert out.scheduled == [] and out.kv_landings == []
    check_pool(scheduler)


def test_a_queued_landing_travels_in_the_next_step_then_the_request_runs() -> None:
    scheduler = make_scheduler()
    request = remote(scheduler)
    landing = landing_of(scheduler)
    assert scheduler.queue_landing(landing) is None
    assert not request.hold_pages and scheduler.has_schedulable
    out = scheduler.schedule()
    assert out.kv_landings == [landing] and out.scheduled == []
    assert scheduler.is_receiving("r")  # not running until the step has written the pages
    assert scheduler.update_from_output(out, {}) == [request]
    assert not scheduler.is_receiving("r") and request.status == RequestStatus.RUNNING
    assert request.output_token_ids == [7] and request.num_computed_tokens == 10
    nxt = scheduler.schedule()
    assert nxt.kv_landings == [] and [n.request_id for n in nxt.new_requests] == ["r"]
    assert [(s.request_id, s.start_pos, s.token_ids) for s in nxt.scheduled] == [("r", 10, [7])]
    assert [g.page_id for g in nxt.scheduled[0].new_pages] == [0, 1, 2]
    check_pool(scheduler)


def test_landed_pages_are_indexed_only_after_the_step_wrote_them() -> None:
    scheduler = make_scheduler(prefix=True)
    remote(scheduler, num_prompt=9)
    assert scheduler.queue_landing(landing_of(scheduler)) is None
    out = scheduler.schedule()
    assert scheduler.kv.num_cached_pages == 0  # queued, not written: nothing to share yet
    scheduler.update_from_output(out, {})
    assert scheduler.kv.num_cached_pages == 2  # the prompt's two full pages


def test_a_landing_for_pages_no_longer_owned_is_refused_and_nothing_is_queued() -> None:
    scheduler = make_scheduler()
    remote(scheduler)
    landing = landing_of(scheduler)
    scheduler.finish_request("r", RequestStatus.FINISHED_ABORTED)  # pages held (a peer writes)
    assert scheduler.held["r"][0] == [2, 1, 0]
    scheduler.release_held("r")  # the peer stopped: freed, tags bumped
    violation = scheduler.queue_landing(landing)
    assert violation is not None and violation.kind == ViolationKind.STALE_WRITE
    assert not scheduler.has_schedulable and scheduler.schedule().kv_landings == []
    check_pool(scheduler)


def test_a_request_ending_while_its_landing_waits_frees_its_pages_and_drops_it() -> None:
    scheduler = make_scheduler()
    remote(scheduler)
    assert scheduler.queue_landing(landing_of(scheduler)) is None
    scheduler.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.held  # the writer is local: nothing to wait for
    assert scheduler.kv.num_free_pages == 8
    assert scheduler.schedule().kv_landings == []


def test_a_request_the_runner_refused_is_not_run_after_the_step() -> None:
    scheduler = make_scheduler()
    remote(scheduler)
    assert scheduler.queue_landing(landing_of(scheduler)) is None
    out = scheduler.schedule()
    scheduler.finish_request("r", RequestStatus.FINISHED_ERROR, "kv_integrity_violation: ...")
    assert scheduler.update_from_output(out, {}) == []
    assert not scheduler.running and scheduler.kv.num_free_pages == 8


def test_a_first_token_that_stops_ends_the_request_after_its_pages_are_indexed() -> None:
    scheduler = make_scheduler(prefix=True)
    request = remote(scheduler, num_prompt=8, max_tokens=1)
    assert scheduler.queue_landing(landing_of(scheduler)) is None
    out = scheduler.schedule()
    assert scheduler.update_from_output(out, {}) == [request]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.kv.num_cached_pages == 2 and scheduler.kv.num_free_pages == 8
    assert [r.request_id for r in scheduler.schedule().new_requests] == []


def test_reserving_counts_against_the_sequence_slots() -> None:
    scheduler = make_scheduler(max_seqs=1)
    remote(scheduler, "a")
    remote(scheduler, "b")
    assert scheduler.reserve_remote("a") is not None
    assert scheduler.reserve_remote("b") is None  # the one slot is a's
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.release_held("a")
    assert scheduler.reserve_remote("b") is not None


def test_a_prefill_sides_held_pages_are_given_back_in_block_order() -> None:
    scheduler = make_scheduler()
    request = Request("p", list(range(10, 19)), SamplingParams(max_tokens=1), hold_pages=True)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"p": 5})
    assert request.is_finished and scheduler.held_page_ids("p") == [0, 1, 2]
    assert scheduler.num_held_pages == 3
    scheduler.release_held("p")
    scheduler.release_held("p")  # idempotent
    assert scheduler.held_page_ids("p") is None and scheduler.kv.num_free_pages == 8
