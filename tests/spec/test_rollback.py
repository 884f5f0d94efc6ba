"""Rollback of rejected proposals, exactly: page ids, tags, the prefix cache, the runner's mirror.

Torch-free: the scheduler and KV manager run on integer page ids (page size 4, 8 pages; a page's
tag starts at its id and grows by 8 each time it is allocated or freed).
"""

from __future__ import annotations

from densa.cache.kv_manager import KVCacheManager
from densa.config import SchedulerConfig
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.mirror import RequestStates
from densa.sched.output import PageGrant, SchedulerOutput
from densa.sched.scheduler import Scheduler

EOS = 2
PROMPT = [10, 11, 12, 13, 14, 15]  # 6 tokens: pages 0 and 1 (the second half full)


def _scheduler() -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=(EOS,)
    )
    return Scheduler(config, KVCacheManager(num_pages=8, page_size=4))


def _prefilled(scheduler: Scheduler, states: RequestStates, **params: object) -> Request:
    """Admit the request and run its prompt step, which samples token 20."""
    request = Request("r", list(PROMPT), SamplingParams(**params))  # type: ignore[arg-type]
    scheduler.add_request(request)
    step = scheduler.schedule()
    states.apply(step)
    scheduler.update_from_output(step, {"r": 20})
    return request


def _verify(
    scheduler: Scheduler,
    states: RequestStates,
    proposed: list[int],
    accepted: list[int],
    token: int,
) -> SchedulerOutput:
    request = scheduler.requests["r"]
    request.spec_token_ids = list(proposed)
    step = scheduler.schedule()
    states.apply(step)
    scheduler.update_from_output(step, {"r": token}, {"r": accepted})
    return step


def test_rejected_pages_are_released_with_new_tags_and_regranted() -> None:
    scheduler, states = _scheduler(), RequestStates()
    request = _prefilled(scheduler, states, max_tokens=20)
    assert (request.page_ids, request.page_tags) == ([0, 1], [8, 9])

    # Token 20 at position 6 and five proposals at 7..11: a third page for positions 8..11.
    step = _verify(scheduler, states, [21, 22, 23, 24, 25], accepted=[21], token=30)
    (chunk,) = step.scheduled
    assert (chunk.token_ids, chunk.start_pos, chunk.spec_token_ids) == (
        [20],
        6,
        [21, 22, 23, 24, 25],
    )
    assert chunk.new_pages == [PageGrant(2, 2, 10)]
    assert step.num_scheduled_tokens == 6 and step.num_spec_tokens == 5
    # 21 accepted, 30 sampled after it: positions 0..7 hold accepted K/V, so page 2 (positions
    # 8..11, only rejected proposals) goes back with a new tag.
    assert request.output_token_ids == [20, 21, 30]
    assert request.num_computed_tokens == 8
    assert (request.page_ids, request.page_tags) == ([0, 1], [8, 9])
    assert scheduler.kv.pool.tag(2) == 18 and scheduler.kv.pool.is_free(2)
    assert scheduler.kv.num_cached_pages == 2  # both pages are full of accepted tokens

    # The next decode computes token 30 at position 8: page 2 again (front of the free queue,
    # it held nothing reusable), newly tagged; the runner learns 21 with it.
    step = scheduler.schedule()
    (chunk,) = step.scheduled
    assert (chunk.token_ids, chunk.start_pos, chunk.accepted_token_ids) == ([30], 8, [21])
    assert chunk.spec_token_ids == []
    assert chunk.new_pages == [PageGrant(2, 2, 26)]
    assert step.tag_updates == [(2, 18), (2, 26)]
    (resolved,) = states.apply(step)
    assert resolved.output_token_ids == [20, 21, 30]
    assert (resolved.page_ids, resolved.page_tags) == ([0, 1, 2], [8, 9, 26])
    scheduler.kv.pool.check_consistency({"r": request.page_ids})


def test_a_partly_used_last_page_is_kept() -> None:
    scheduler, states = _scheduler(), RequestStates()
    request = _prefilled(scheduler, states, max_tokens=20)
    # Positions 6..9 (page 2 for 8, 9); nothing accepted: position 6 alone is kept, in page 1.
    _verify(scheduler, states, [21, 22, 23], accepted=[], token=31)
    assert request.output_token_ids == [20, 31] and request.num_computed_tokens == 7
    assert (request.page_ids, request.page_tags) == ([0, 1], [8, 9])
    assert scheduler.kv.pool.tag(2) == 18
    # Two of three accepted: positions 7..9 hold accepted tokens, page 2 stays mapped.
    _verify(scheduler, states, [32, 33, 34], accepted=[32, 33], token=35)
    assert request.output_token_ids == [20, 31, 32, 33, 35]
    assert request.num_computed_tokens == 10
    assert (request.page_ids, request.page_tags) == ([0, 1, 2], [8, 9, 26])
    assert scheduler.kv.num_cached_pages == 2  # page 2 is not full: never indexed


def test_a_stop_inside_the_accepted_run_cuts_it() -> None:
    scheduler, states = _scheduler(), RequestStates()
    request = _prefilled(scheduler, states, max_tokens=20)
    _verify(scheduler, states, [21, EOS, 23], accepted=[21, EOS, 23], token=40)
    assert request.output_token_ids == [20, 21, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv.num_free_pages == 8
    # Positions 0..8 were computed and kept (EOS included): the two full pages stay cached.
    assert scheduler.kv.num_cached_pages == 2


def test_max_tokens_inside_the_accepted_run_cuts_it() -> None:
    scheduler, states = _scheduler(), RequestStates()
    request = _prefilled(scheduler, states, max_tokens=3)
    _verify(scheduler, states, [21, 22, 23], accepted=[21, 22, 23], token=40)
    assert request.output_token_ids == [20, 21, 22]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.kv.num_free_pages == 8


def test_proposals_stop_at_the_context_and_the_budget() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3, max_model_len=9)
    scheduler = Scheduler(config, KVCacheManager(num_pages=8, page_size=4))
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=20))
    scheduler.add_request(request)
    for token in (20, 21):  # the prompt in two chunks (budget 3), then 20
        step = scheduler.schedule()
        scheduler.update_from_output(step, {"r": token} if step.scheduled[0].sample else {})
    assert request.num_tokens == 7
    request.spec_token_ids = [30, 31, 32, 33]
    (chunk,) = scheduler.schedule().scheduled
    # Budget 3: the token and two proposals; the context (9) would have allowed two as well.
    assert chunk.spec_token_ids == [30, 31]


def test_preemption_drops_proposals_and_resends_every_token() -> None:
    scheduler, states = _scheduler(), RequestStates()
    request = _prefilled(scheduler, states, max_tokens=20)
    _verify(scheduler, states, [21, 22], accepted=[21, 22], token=23)
    assert request.unsent_token_ids == [21, 22]
    request.spec_token_ids = [24]
    scheduler._preempt(request)
    assert request.spec_token_ids == [] and request.page_ids == []
    assert scheduler.schedule().preempted_request_ids == ["r"]  # re-admitted on the next step
    step = scheduler.schedule()
    (new,) = step.new_requests
    assert new.output_token_ids == [20, 21, 22, 23]
    assert step.scheduled[0].accepted_token_ids == [] and step.scheduled[0].spec_token_ids == []
