"""Who speculates, with how many tokens: adaptive k, probes, opt-outs, caps, the batch limit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from densa.cache.integrity import IntegrityViolation
from densa.config import SpeculativeConfig
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams, StructuredOutput
from densa.sched.output import ScheduledChunk, SchedulerOutput
from densa.spec.proposer import SpecInput, TargetRows
from densa.spec.speculator import (
    PROBE_INTERVAL,
    VERIFY_ROW_COST,
    Speculator,
    best_num_tokens,
    row_cost,
)

MAX_MODEL_LEN = 100


class Fixed:
    name = "fixed"
    needs_hidden_states = False
    prompt_states = None

    def __init__(self, cost_per_token: float = 0.0, catch_up_cost_per_token: float = 0.0) -> None:
        self.cost_per_token = cost_per_token
        self.catch_up_cost_per_token = catch_up_cost_per_token
        self.seen: list[SpecInput] = []
        self.released: list[str] = []
        self.observed: list[tuple[str, int, list[int], int]] = []  # id, start, tokens, rows

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        self.seen.extend(inputs)
        return [[9] * item.num_tokens for item in inputs]

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        self.observed.append((request_id, rows.start_pos, rows.token_ids, rows.hidden.shape[0]))

    def take_violations(self) -> list[IntegrityViolation]:
        return []


def _decoding(request_id: str, num_output: int = 1, **params: object) -> Request:
    request = Request(request_id, [1, 2, 3, 4], SamplingParams(**{"max_tokens": 50, **params}))  # type: ignore[arg-type]
    request.output_token_ids = list(range(10, 10 + num_output))
    request.num_computed_tokens = request.num_tokens - 1
    request.status = RequestStatus.RUNNING
    return request


def _verified(
    request: Request, accepted: list[int]
) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    chunk = ScheduledChunk(request.request_id, [0], 0, [], True, list(request.spec_token_ids))
    request.spec_token_ids = []
    return SchedulerOutput([chunk], [], [], []), {request.request_id: accepted}


def test_k_follows_acceptance_down_to_zero_then_probes() -> None:
    speculator = Speculator(Fixed(), SpeculativeConfig(num_tokens=4))
    request = _decoding("r")
    ks = []
    for _ in range(6):
        speculator.propose([request], MAX_MODEL_LEN)
        ks.append(len(request.spec_token_ids))
        speculator.observe(*_verified(request, []))  # every proposal rejected
    # Estimated acceptance 1.0, 0.62, 0.42, 0.30, 0.22, 0.16, each proposal a verify row of
    # 0.17: k maximises (1 + p + .. + p**k) / (1 + 0.17 k); at 0.16 one proposal costs more than
    # it is expected to gain.
    assert ks == [4, 2, 1, 1, 1, 0]
    for _ in range(PROBE_INTERVAL - 2):
        speculator.propose([request], MAX_MODEL_LEN)
        assert request.spec_token_ids == []
    speculator.propose([request], MAX_MODEL_LEN)
    assert request.spec_token_ids == [9]  # the probe
    speculator.observe(*_verified(request, [9]))  # accepted: the estimate rises again
    speculator.propose([request], MAX_MODEL_LEN)
    assert len(request.spec_token_ids) == 1
    assert (speculator.num_proposed_tokens, speculator.num_accepted_tokens) == (10, 1)


def test_k_weighs_acceptance_against_what_a_proposal_costs() -> None:
    assert VERIFY_ROW_COST == 0.17
    # 1 + p + .. + p**k over 1 + c k at p = 0.9, k <= 8: prompt lookup (a verify row) goes to 7;
    # a draft model whose step costs 0.32 of the target's stops at 3.
    assert [best_num_tokens(0.9, 8, c) for c in (0.17, 0.17 + 0.32)] == [7, 3]
    assert best_num_tokens(1.0, 8, 0.9) == 8  # every proposal a token: worth any cost below 1
    assert best_num_tokens(0.1, 8, 0.05) == 1 and best_num_tokens(0.1, 8, 0.11) == 0
    # Four decoding requests share a step of 4 + their proposals' rows: a row costs more of each
    # one's share (0.17 * 4 / 1.51).
    assert row_cost(1) == VERIFY_ROW_COST and abs(row_cost(4) - 0.68 / 1.51) < 1e-12
    ngram, draft = (
        Speculator(Fixed(), SpeculativeConfig(num_tokens=8)),
        Speculator(Fixed(cost_per_token=0.32), SpeculativeConfig(num_tokens=8)),
    )
    alone, drafted = [_decoding("a")], [_decoding("d")]
    batch = [_decoding(f"b{i}") for i in range(4)]
    for speculator, requests in ((ngram, alone), (draft, drafted), (ngram, batch)):
        speculator.propose(requests, MAX_MODEL_LEN)  # fresh: 8 each
        assert all(len(r.spec_token_ids) == 8 for r in requests)
        for request in requests:  # 4 accepted, the 5th rejected: the estimate is 5.6 / 6.6
            speculator.observe(*_verified(request, [9] * 4))
        speculator.propose(requests, MAX_MODEL_LEN)
    # p = 0.85: alone 5 rows; with the draft's own cost 2; in a batch of four 3 each.
    assert [len(r.spec_token_ids) for r in (*alone, *drafted, *batch)] == [5, 2, 3, 3, 3, 3]


def test_full_acceptance_keeps_k_at_its_most() -> None:
    speculator = Speculator(Fixed(), SpeculativeConfig(num_tokens=5))
    request = _decoding("r")
    for _ in range(5):
        speculator.propose([request], MAX_MODEL_LEN)
        assert len(request.spec_token_ids) == 5
        speculator.observe(*_verified(request, [9] * 5))


def test_opt_outs_constraints_and_caps() -> None:
    proposer = Fixed()
    speculator = Speculator(proposer, SpeculativeConfig(num_tokens=4))
    opted_out = _decoding("off", speculative=False)
    constrained = _decoding("json", structured=StructuredOutput("json_object"))
    near_max_tokens = _decoding("short", num_output=48)  # 2 left: the token, one proposal
    near_context = _decoding(
        "long", num_output=94, max_tokens=500
    )  # 98 of 100 tokens: two positions left
    requests = [opted_out, constrained, near_max_tokens, near_context]
    speculator.propose(requests, MAX_MODEL_LEN)
    assert [len(r.spec_token_ids) for r in requests] == [0, 0, 1, 2]
    assert [item.request_id for item in proposer.seen] == ["short", "long"]
    assert list(proposer.seen[0].token_ids) == near_max_tokens.all_token_ids


def test_deterministic_mode_speculates_for_greedy_requests_only() -> None:
    """--deterministic: a sampled request's draws would depend on how many proposals it
    verified, and so on the batch (speculation pauses above max_batch); greedy ones stay."""
    for greedy_only, expected in [(False, [2, 2]), (True, [2, 0])]:
        proposer = Fixed()
        speculator = Speculator(proposer, SpeculativeConfig(num_tokens=2), greedy_only)
        requests = [_decoding("greedy", temperature=0.0), _decoding("sampled", seed=3)]
        speculator.propose(requests, MAX_MODEL_LEN)
        assert [len(r.spec_token_ids) for r in requests] == expected
        assert proposer.released == ([] if not greedy_only else ["sampled"])


def test_a_large_batch_pauses_speculation() -> None:
    speculator = Speculator(Fixed(), SpeculativeConfig(num_tokens=2, max_batch=3))
    requests = [_decoding(f"r{i}") for i in range(4)]
    speculator.propose(requests, MAX_MODEL_LEN)
    assert all(r.spec_token_ids == [] for r in requests) and speculator.num_paused_steps == 1
    speculator.propose(requests[:3], MAX_MODEL_LEN)
    assert all(r.spec_token_ids == [9, 9] for r in requests[:3])


def test_a_step_that_computes_a_prompt_pauses_speculation() -> None:
    """A prefill chunk makes the step compute-bound: verify rows would cost their full price
    (and a draft its catch-up), so nobody speculates in it: neither beside a running request's
    next chunk nor when a queued request may be admitted."""
    speculator = Speculator(Fixed(), SpeculativeConfig(num_tokens=2))
    decoding = _decoding("d")
    prefilling = _decoding("p")
    prefilling.num_computed_tokens = 2
    speculator.propose([decoding, prefilling], MAX_MODEL_LEN)
    assert decoding.spec_token_ids == [] and speculator.num_paused_steps == 1
    speculator.propose([decoding], MAX_MODEL_LEN, prompt_queued=True)
    assert decoding.spec_token_ids == [] and speculator.num_paused_steps == 2
    speculator.propose([decoding], MAX_MODEL_LEN)
    assert decoding.spec_token_ids == [9, 9]


def test_requests_that_stop_running_are_released() -> None:
    proposer = Fixed()
    speculator = Speculator(proposer, SpeculativeConfig())
    speculator.propose([_decoding("a"), _decoding("b")], MAX_MODEL_LEN)
    speculator.keep_only(["b"])
    assert proposer.released == ["a"]
    speculator.keep_only([])
    assert proposer.released == ["a", "b"]


def test_hidden_states_go_with_their_positions_and_tokens_and_never_for_opt_outs() -> None:
    """The proposer learns which positions and tokens the target kept (the chunk's own and the
    proposals accepted, not the rejected rows); a request that never speculates is released
    once and its states are not handed on (an MTP layer would fold them for nothing)."""
    proposer = Fixed()
    speculator = Speculator(proposer, SpeculativeConfig(num_tokens=4))
    on, off = _decoding("on"), _decoding("off", speculative=False)
    speculator.propose([on, off], MAX_MODEL_LEN)
    assert on.spec_token_ids == [9, 9, 9, 9] and proposer.released == ["off"]
    chunks = [ScheduledChunk("on", [7], 4, [], True, [9, 9, 9, 9]),
              ScheduledChunk("off", [8], 4, [], True)]  # fmt: skip
    rows = {"on": torch.zeros(5, 3), "off": torch.zeros(1, 3)}
    speculator.observe_hidden(SchedulerOutput(chunks, [], [], []), {"on": [9, 9]}, rows)
    assert proposer.observed == [("on", 4, [7, 9, 9], 3)]
    speculator.propose([on, off], MAX_MODEL_LEN)
    assert proposer.released == ["off"]  # once
    speculator.keep_only(["on"])  # "off" stopped running (preempted): forgotten ...
    speculator.propose([on, off], MAX_MODEL_LEN)
    assert proposer.released == ["off", "off"]  # ... so its recomputed prompt is released again


def test_a_draft_catches_up_only_where_the_tokens_left_repay_it() -> None:
    """A proposer that must first compute the context it has not seen (a draft prefilling a
    300-token prompt at 0.1 of a target step a token: 30 steps) starts only when what its
    guesses are expected to save over the tokens the request may still generate is more; once
    it proposes, a step's own catch-up (the tokens accepted) is not charged again."""
    speculator = Speculator(Fixed(catch_up_cost_per_token=0.1), SpeculativeConfig(num_tokens=4))
    prompt = list(range(300))
    short = Request("short", prompt, SamplingParams(max_tokens=20))
    long = Request("long", prompt, SamplingParams(max_tokens=500))
    for request in (short, long):
        request.output_token_ids = [7]
        request.num_computed_tokens = request.num_tokens - 1
        request.status = RequestStatus.RUNNING
    # p = 1 (a fresh request), k = 4, two decoding: a verify row costs 0.29 of a request's
    # share of the step, so 5 tokens for 2.16 shares save 0.57 share a token, a share being
    # 0.585 of a step: 19 tokens left save 6.3 steps < 30, 499 save 166.
    speculator.propose([short, long], MAX_MODEL_LEN + 400)
    assert short.spec_token_ids == [] and long.spec_token_ids == [9, 9, 9, 9]
    long.output_token_ids += [9, 9, 9, 9, 9]  # all accepted, and the bonus token
    long.num_computed_tokens = long.num_tokens - 1
    long.spec_token_ids = []
    speculator.observe(*_verified(long, [9, 9, 9, 9]))
    long.sampling_params = SamplingParams(max_tokens=len(long.output_token_ids) + 6)
    speculator.propose([long], MAX_MODEL_LEN + 400)  # few tokens left, but nothing to catch up
    assert long.spec_token_ids == [9, 9, 9, 9]
