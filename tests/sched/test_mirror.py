"""The runner's mirror of running requests, built from deltas: exact page tables and tokens, and
applying a step twice (a retried step under fault confinement) changes nothing."""

from __future__ import annotations

import pytest

from densa.sampling_params import SamplingParams
from densa.sched.mirror import RequestStates, UnknownRequest
from densa.sched.output import NewRequest, PageGrant, ScheduledChunk, SchedulerOutput

PARAMS = SamplingParams(max_tokens=4)


def step(
    chunks: list[ScheduledChunk], new: list[NewRequest] | None = None, **ids
) -> SchedulerOutput:  # type: ignore[no-untyped-def]
    return SchedulerOutput(
        chunks, [], ids.get("finished", []), ids.get("preempted", []), new_requests=new or []
    )


def test_page_table_and_tokens_grow_from_deltas() -> None:
    states = RequestStates()
    prefill = ScheduledChunk(
        "a", [1, 2, 3, 4, 5], 0, [PageGrant(0, 6, 16), PageGrant(1, 2, 12)], True
    )
    (item,) = states.apply(step([prefill], [NewRequest("a", [1, 2, 3, 4, 5], PARAMS)]))
    assert (item.page_ids, item.page_tags, item.output_token_ids) == ([6, 2], [16, 12], [])
    assert not item.is_decode
    decode = ScheduledChunk("a", [9], 5, [], True)  # the token sampled last step comes back
    (item,) = states.apply(step([decode]))
    assert (item.page_ids, item.output_token_ids, item.end_pos) == ([6, 2], [9], 6)
    assert item.is_decode
    decode = ScheduledChunk("a", [8], 6, [], True)
    (item,) = states.apply(step([decode]))
    assert item.output_token_ids == [9, 8]


def test_applying_a_step_twice_changes_nothing() -> None:
    states = RequestStates()
    new = [NewRequest("a", [1, 2, 3], PARAMS)]
    chunks = [ScheduledChunk("a", [1, 2, 3], 0, [PageGrant(0, 4, 14)], True)]
    states.apply(step(chunks, new))
    (item,) = states.apply(step(chunks, new))
    assert (item.page_ids, item.page_tags, item.output_token_ids) == ([4], [14], [])
    decode = [ScheduledChunk("a", [7], 3, [PageGrant(1, 5, 15)], True)]
    states.apply(step(decode))
    (item,) = states.apply(step(decode))
    assert (item.page_ids, item.output_token_ids) == ([4, 5], [7])


def test_an_ended_or_preempted_request_is_forgotten_and_a_resumed_one_starts_over() -> None:
    states = RequestStates()
    states.apply(step([ScheduledChunk("a", [1, 2], 0, [PageGrant(0, 3, 3)], True)],
                      [NewRequest("a", [1, 2], PARAMS)]))  # fmt: skip
    states.apply(step([], preempted=["a"]))
    assert "a" not in states
    resumed = NewRequest("a", [1, 2], PARAMS, output_token_ids=[9])
    chunk = ScheduledChunk("a", [1, 2, 9], 0, [PageGrant(0, 7, 27)], True)
    (item,) = states.apply(step([chunk], [resumed]))
    assert (item.page_ids, item.output_token_ids) == ([7], [9])  # recomputed, not appended twice
    states.apply(step([], finished=["a"]))
    assert len(states) == 0


def test_a_chunk_for_an_unknown_request_or_a_gap_in_the_table_is_refused() -> None:
    states = RequestStates()
    with pytest.raises(UnknownRequest):
        states.apply(step([ScheduledChunk("ghost", [1], 0, [], True)]))
    new = [NewRequest("a", [1], PARAMS)]
    with pytest.raises(UnknownRequest, match="skips"):
        states.apply(step([ScheduledChunk("a", [1], 0, [PageGrant(1, 2, 2)], True)], new))
