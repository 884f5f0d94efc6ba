"""The one stop rule, asked by the scheduler (does this token end the request?) and the sampler
(which tokens must wait for min_tokens?)."""

from __future__ import annotations

from densa.request import RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.stop import StopRule

RULE = StopRule(eos_token_ids=(2, 7), max_model_len=20)


def test_ending_tokens_are_stop_ids_plus_eos_unless_ignored() -> None:
    assert RULE.ending_tokens(SamplingParams(stop_token_ids=[5])) == {2, 5, 7}
    assert RULE.ending_tokens(SamplingParams(stop_token_ids=[5], ignore_eos=True)) == {5}


def test_status_of_the_new_token() -> None:
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5])
    assert RULE.status(params, num_output=1, num_tokens=9, token_id=2) is None  # below min_tokens
    assert (
        RULE.status(params, num_output=2, num_tokens=10, token_id=2)
        == RequestStatus.FINISHED_STOPPED
    )
    assert (
        RULE.status(params, num_output=2, num_tokens=10, token_id=5)
        == RequestStatus.FINISHED_STOPPED
    )
    assert RULE.status(params, num_output=3, num_tokens=11, token_id=9) is None
    assert (
        RULE.status(params, num_output=4, num_tokens=12, token_id=9)
        == RequestStatus.FINISHED_LENGTH
    )
    # The context is full: the answer ends whatever max_tokens says.
    assert RULE.status(SamplingParams(max_tokens=99), 3, 20, 9) == RequestStatus.FINISHED_LENGTH
    ignoring = SamplingParams(max_tokens=9, ignore_eos=True)
    assert RULE.status(ignoring, num_output=3, num_tokens=11, token_id=2) is None
