"""Scheduler decisions, exactly: token budget, chunked prefill, FCFS admission, preemption, stops."""

from __future__ import annotations

from densa.cache.kv_manager import KVCacheManager
from densa.config import SchedulerConfig
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.output import PageGrant
from densa.sched.scheduler import Scheduler


def make_scheduler(
    num_pages: int = 16, page_size: int = 4, budget: int = 8, max_seqs: int = 8
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64, eos_token_ids=(2,)
    )
    return Scheduler(config, KVCacheManager(num_pages, page_size, enable_prefix_caching=False))


def make_request(rid: str, num_prompt: int, max_tokens: int = 4, **params: object) -> Request:
    params_ = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(rid, list(range(10, 10 + num_prompt)), params_)


def step(scheduler: Scheduler, token: int = 7) -> list[tuple[str, int, int]]:
    """Schedule, pretend the model ran and sampled `token`; return (id, start, num_tokens) per request."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, {s.request_id: token for s in out.scheduled if s.sample})
    owners = {rid: r.page_ids for rid, r in scheduler.requests.items()}
    scheduler.kv.pool.check_consistency(owners)
    return [(s.request_id, s.start_pos, s.num_tokens) for s in out.scheduled]


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 20))
    assert step(scheduler) == [("a", 0, 8)]
    assert step(scheduler) == [("a", 8, 8)]
    assert step(scheduler) == [("a", 16, 4)]  # the last chunk samples the first output token
    assert scheduler.requests["a"].output_token_ids == [7]
    assert step(scheduler) == [("a", 20, 1)]  # decode


def test_decodes_go_first_and_new_requests_share_the_leftover_budget() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 3))
    assert step(scheduler) == [("a", 0, 3)]
    scheduler.add_request(make_request("b", 10))
    scheduler.add_request(make_request("c", 2))
    assert step(scheduler) == [("a", 3, 1), ("b", 0, 7)]
    assert step(scheduler) == [("a", 4, 1), ("b", 7, 3), ("c", 0, 2)]


def test_pages_follow_the_tokens_exactly() -> None:
    scheduler = make_scheduler(num_pages=8, page_size=4, budget=16)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 3))
    out = scheduler.schedule()
    assert [(s.request_id, s.new_pages) for s in out.scheduled] == [
        ("a", [PageGrant(0, 0, 8), PageGrant(1, 1, 9)]),
        ("b", [PageGrant(0, 2, 10)]),
    ]
    assert out.tag_updates == [(0, 8), (1, 9), (2, 10)]


def test_each_step_sends_only_what_changed() -> None:
    """Prompts and parameters cross once; then only new tokens and newly mapped pages."""
    scheduler = make_scheduler(num_pages=8, page_size=4, budget=16)
    scheduler.add_request(make_request("a", 7, max_tokens=8))
    first = scheduler.schedule()
    assert [(n.request_id, len(n.prompt_token_ids)) for n in first.new_requests] == [("a", 7)]
    scheduler.update_from_output(first, {"a": 70})
    second = scheduler.schedule()  # position 7: still the second page
    assert second.new_requests == []
    assert [(c.token_ids, c.start_pos, c.new_pages) for c in second.scheduled] == [([70], 7, [])]
    scheduler.update_from_output(second, {"a": 71})
    third = scheduler.schedule()  # position 8 opens a third page: exactly that grant
    assert [(c.token_ids, c.new_pages) for c in third.scheduled] == [([71], [PageGrant(2, 2, 10)])]


def test_a_preempted_request_is_sent_again_whole() -> None:
    scheduler = make_scheduler(num_pages=4, page_size=4, budget=32)
    scheduler.add_request(make_request("a", 7, max_tokens=8))
    scheduler.add_request(make_request("b", 8, max_tokens=8))
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": 70, "b": 80})
    out = scheduler.schedule()  # b needs a 5th page: preempted
    assert out.preempted_request_ids == ["b"]
    scheduler.update_from_output(out, {"a": 71})
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()  # b comes back: prompt + its output so far, pages from index 0
    (new,) = out.new_requests
    assert (new.request_id, new.output_token_ids) == ("b", [80])
    (chunk,) = out.scheduled
    assert (chunk.start_pos, chunk.token_ids[-1]) == (0, 80)
    assert [g.index for g in chunk.new_pages] == [0, 1, 2]


def test_out_of_pages_preempts_the_newest_running_request() -> None:
    # 4 pages of 4 tokens. a: 7 prompt tokens (2 pages), b: 8 (2 pages, full).
    scheduler = make_scheduler(num_pages=4, page_size=4, budget=32)
    scheduler.add_request(make_request("a", 7, max_tokens=8))
    scheduler.add_request(make_request("b", 8, max_tokens=8))
    assert step(scheduler) == [("a", 0, 7), ("b", 0, 8)]
    assert step(scheduler) == [("a", 7, 1)]  # b's decode needs a 5th page: b (newest) is preempted
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.page_ids == [] and b.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    # b waits (FCFS head) until a is done, then recomputes its prompt + first output token.
    while scheduler.requests.get("a") is not None:
        step(scheduler)
    assert step(scheduler) == [("b", 0, 9)]


def test_many_requests_in_a_tight_pool_all_finish() -> None:
    scheduler = make_scheduler(num_pages=4, page_size=4, budget=32)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 3 + i, max_tokens=16 - 2 * i))
    steps = 0
    while scheduler.has_unfinished:
        step(scheduler)
        steps += 1
        assert steps < 200, "no progress"
    assert scheduler.num_preemptions > 0
    assert scheduler.kv.num_free_pages == 4


def test_a_request_larger_than_the_whole_pool_fails_instead_of_spinning() -> None:
    scheduler = make_scheduler(num_pages=3, page_size=4, budget=32)
    scheduler.add_request(make_request("a", 8, max_tokens=8))  # needs 16 tokens > 12 slots
    for _ in range(10):
        step(scheduler)
    assert not scheduler.has_unfinished
    assert scheduler.kv.num_free_pages == 3


def test_queue_head_is_never_skipped() -> None:
    scheduler = make_scheduler(num_pages=4, page_size=4, budget=32)
    scheduler.add_request(make_request("a", 12, max_tokens=2))  # 3 pages
    step(scheduler)
    scheduler.add_request(make_request("big", 8))  # needs 2 pages, only 1 free: waits
    scheduler.add_request(make_request("small", 2))  # would fit, but must not overtake
    assert step(scheduler) == [("a", 12, 1)]
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]


def test_a_request_held_for_a_kv_tier_is_passed_over_and_keeps_its_place() -> None:
    """Its lookup must not delay the requests behind it (engine/kv_tiers.py); once it ends,
    the request is admitted first again, and the room rule still holds behind it."""
    scheduler = make_scheduler(num_pages=4, page_size=4, budget=32)
    for rid, num_prompt in (("held", 4), ("next", 2), ("big", 16), ("small", 2)):
        scheduler.add_request(make_request(rid, num_prompt, max_tokens=2))
    scheduler.hold_for_fetch("held")
    assert step(scheduler) == [("next", 0, 2)]  # "big" needs 4 pages, 3 are free: it waits...
    assert [r.request_id for r in scheduler.waiting] == ["held", "big", "small"]  # ...and "small"
    scheduler.end_fetch("held")
    assert step(scheduler) == [("next", 2, 1), ("held", 0, 4)]
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]


def test_max_num_seqs_bounds_the_running_set() -> None:
    scheduler = make_scheduler(budget=64, max_seqs=2)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 2))
    assert [s[0] for s in step(scheduler)] == ["a", "b"]


def test_stop_conditions() -> None:
    scheduler = make_scheduler(budget=64)
    scheduler.add_request(make_request("eos", 2))
    scheduler.add_request(make_request("ignore", 2, ignore_eos=True, max_tokens=2))
    scheduler.add_request(make_request("stop_id", 2, stop_token_ids=[2]))
    scheduler.add_request(make_request("min", 2, min_tokens=2))
    out = scheduler.schedule()
    finished = scheduler.update_from_output(out, {s.request_id: 2 for s in out.scheduled})
    assert {r.request_id: r.status for r in finished} == {
        "eos": RequestStatus.FINISHED_STOPPED,
        "ignore": RequestStatus.RUNNING,
        "stop_id": RequestStatus.FINISHED_STOPPED,
        "min": RequestStatus.RUNNING,
    }
    step(scheduler, token=5)  # "ignore" reaches max_tokens=2
    assert scheduler.requests["min"].status == RequestStatus.RUNNING
    assert "ignore" not in scheduler.requests
    assert list(scheduler.requests) == ["min"]


def test_abort_frees_pages_and_is_reported_to_the_worker() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6))
    step(scheduler)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.num_free_pages == 16
    assert scheduler.schedule().finished_request_ids == ["a"]
    assert scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED) is None  # idempotent
