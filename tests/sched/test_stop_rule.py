"""The one stop rule, asked by the scheduler (does this token end the request?) and the sampler
(which tokens must wait for min_tokens?)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from densa import sampling_params
from densa.request import RequestStatus
from densa.sampling_params import (
    MAX_ENGINE_STOP_TOKEN_IDS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from densa.sched import stop
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


def test_the_stop_set_is_built_once_per_request_not_per_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler asks after every sampled token of every request: a set rebuilt from the
    request's stop ids each time cost one tenant's decode in proportion to another's list."""
    stop_ids = frozenset(range(100, 100 + MAX_STOP_TOKEN_IDS))
    builds: list[int] = []

    def counting(items: Iterable[int] = ()) -> frozenset[int]:
        built = frozenset(items)
        builds.extend([1] if built >= stop_ids else [])
        return built

    for module in (sampling_params, stop):
        monkeypatch.setattr(module, "frozenset", counting, raising=False)
    params = SamplingParams(max_tokens=10_000, stop_token_ids=sorted(stop_ids))
    rule = StopRule(eos_token_ids=(2,), max_model_len=100_000)
    for num_output in range(1, 1001):
        assert rule.status(params, num_output, num_output + 10, token_id=9) is None
    assert rule.status(params, 1001, 1011, token_id=100 + MAX_STOP_TOKEN_IDS - 1) is not None
    assert len(builds) == 1


def test_stop_token_ids_are_bounded_like_stop_strings() -> None:
    """A client may send 16 (the API's bound, tests/serve/test_bounds.py); the engine takes
    those plus as many the server adds (FIM's separators), and no more."""
    SamplingParams(stop_token_ids=range(MAX_ENGINE_STOP_TOKEN_IDS))
    with pytest.raises(ValueError, match=f"at most {MAX_ENGINE_STOP_TOKEN_IDS} stop_token_ids"):
        SamplingParams(stop_token_ids=range(MAX_ENGINE_STOP_TOKEN_IDS + 1))
