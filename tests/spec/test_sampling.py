"""Speculative sampling keeps the target's distribution, and seeds still reproduce.

The sampler verifies point-mass proposals: accept x with probability p(x), else draw from p
without x; a bonus token from the last row. Chi-square tests over many draws on a 6-token
vocabulary check that the first, second and third emitted tokens have exactly the target's
(conditional) distributions, for proposals the target likes and ones it does not.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from densa.cache.integrity import IntegrityViolation
from densa.config import SpeculativeConfig
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.spec.proposer import SpecInput, TargetRows
from densa.spec.speculator import Speculator
from densa.worker.sampler import Sampler, SampleRequest

NUM_DRAWS = 6000
BATCH = 1000
# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one
# of these tests once in a thousand runs (draws are seeded, so a given run is reproducible).
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
LOGITS = torch.tensor(
    [
        [0.5, 1.5, -0.3, 0.9, 0.0, -1.0],  # p0
        [1.2, -0.4, 0.3, 0.6, -0.8, 0.1],  # p1: the token after x0
        [-0.2, 0.4, 1.1, -0.6, 0.7, 0.2],  # p2: the token after x0 x1
    ]
)


def _chi2(counts: Counter[int], probs: torch.Tensor) -> tuple[float, int]:
    total = sum(counts.values())
    support = [t for t in range(probs.shape[0]) if probs[t] > 0]
    assert set(counts) <= set(support), "a token outside the distribution's support"
    stat = sum(
        (counts[t] - total * float(probs[t])) ** 2 / (total * float(probs[t])) for t in support
    )
    return stat, len(support) - 1


def _draws(params: SamplingParams, drafts: tuple[int, ...]) -> list[list[int]]:
    """NUM_DRAWS verifications of `drafts` against LOGITS (one seeded request each, in batches
    of BATCH): the emitted tokens of each."""
    sampler = Sampler()
    logits = LOGITS[: len(drafts) + 1]
    emitted = []
    for start in range(0, NUM_DRAWS, BATCH):
        rows = [
            SampleRequest(f"r{i}", _seeded(params, i), [7], [], frozenset(), drafts)
            for i in range(start, start + BATCH)
        ]
        result = sampler.sample(logits.repeat(BATCH, 1), rows)
        emitted.extend([*result.accepted[i], result.token_ids[i]] for i in range(BATCH))
    return emitted


def _seeded(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _target(params: SamplingParams, row: int, seen: Sequence[int]) -> torch.Tensor:
    """The distribution a plain decode step draws from at LOGITS[row] after `seen`."""
    logits = LOGITS[row].clone()
    for token in set(seen):
        logits[token] -= params.presence_penalty
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize(
    ("params", "drafts"),
    [
        (SamplingParams(temperature=1.0), (1, 0)),  # proposals the target likes
        (SamplingParams(temperature=1.0), (5, 3)),  # unlikely ones: mostly rejected
        (SamplingParams(temperature=0.7, top_k=4), (1, 4)),
        (SamplingParams(temperature=1.0, top_k=3), (2, 3)),  # x0 outside the top 3: never kept
        (SamplingParams(temperature=1.0, presence_penalty=1.5), (1, 1)),  # row 1 sees x0
    ],
    ids=["liked", "unlikely", "t0.7-top4", "outside-top3", "presence"],
)
def test_emitted_tokens_have_the_targets_distribution(
    params: SamplingParams, drafts: tuple[int, int]
) -> None:
    emitted = _draws(params, drafts)
    first = Counter(tokens[0] for tokens in emitted)
    second = Counter(tokens[1] for tokens in emitted if len(tokens) > 1)
    third = Counter(tokens[2] for tokens in emitted if len(tokens) > 2)
    checks = [(first, _target(params, 0, []))]
    if sum(second.values()) >= 200:
        checks.append((second, _target(params, 1, drafts[:1])))
    if sum(third.values()) >= 200:
        checks.append((third, _target(params, 2, drafts[:2])))
    for counts, probs in checks:
        stat, dof = _chi2(counts, probs)
        assert stat < CHI2_CRITICAL[dof], (stat, dof, counts, probs)
    # A second token exists exactly when x0 was accepted, as often as p0(x0) says.
    accepted = sum(1 for tokens in emitted if len(tokens) > 1)
    stat, _ = _chi2(
        Counter({1: accepted, 0: NUM_DRAWS - accepted}),
        torch.tensor([1 - float(checks[0][1][drafts[0]]), float(checks[0][1][drafts[0]])]),
    ) if 0 < float(checks[0][1][drafts[0]]) < 1 else (0.0, 1)  # fmt: skip
    assert stat < CHI2_CRITICAL[1]


def test_greedy_rows_see_the_proposals_before_them() -> None:
    # Row 1's argmax is token 0 (1.2), but a frequency penalty on x0 = 0 makes it token 3.
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    sampler = Sampler()
    row = SampleRequest("r", params, [7], [], frozenset(), (1, 0))
    result = sampler.sample(LOGITS.clone(), [row])
    # Row 0 argmax 1 == x0 (accepted); row 1 with 1 penalized: 0 (1.2) still wins == x1; the
    # bonus from row 2 sees 1 and 0 penalized: 2 (1.1) stays the argmax.
    assert (result.accepted[0], result.token_ids[0]) == ([1, 0], 2)
    row = SampleRequest("r", params, [7], [0], frozenset(), (1, 0))  # 0 already in the output
    result = sampler.sample(LOGITS.clone(), [row])
    # Row 1: 0 now penalized twice (1.2 - 2 < 0.6): argmax 3 != x1, so x1 is rejected.
    assert (result.accepted[0], result.token_ids[0]) == ([1], 3)


def test_plain_rows_in_a_verifying_step_sample_as_without_one() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    plain = SampleRequest("p", params, [7], [], frozenset())
    verifying = SampleRequest("v", params, [7], [], frozenset(), (1, 0))
    alone = Sampler().sample(LOGITS[2:].clone(), [plain])
    mixed = Sampler().sample(torch.cat([LOGITS, LOGITS[2:]]), [verifying, plain])
    assert mixed.token_ids[1] == alone.token_ids[0]
    assert 1 not in mixed.accepted and 0 in mixed.accepted


class FixedProposer:
    """Always proposes the same token (rejections guaranteed to happen)."""

    name = "fixed"
    cost_per_token = 0.0
    catch_up_cost_per_token = 0.0
    needs_hidden_states = False
    prompt_states = None

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        return [[self.token_id] * item.num_tokens for item in inputs]

    def release(self, request_id: str) -> None:
        return None

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        return None

    def take_violations(self) -> list[IntegrityViolation]:
        return []


def _sampled_streams(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = [
        SamplingParams(temperature=1.0, top_k=2, max_tokens=16, seed=11 + i) for i in range(3)
    ]
    ids = [engine.add_request(p, params[i % 3]) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        engine.check_invariants()
    return [tokens[i] for i in ids]


def test_seeded_requests_reproduce_with_speculation(tiny_model_dir: Path) -> None:
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, num_kv_pages=200, page_size=4)
    engine = LLMEngine.from_args(args)
    prompts = [[100 + i, 200, 300, 400 + i] for i in range(3)]
    plain = _sampled_streams(engine, prompts)
    # The token the tiny model's first decode step most likes, so some proposals are kept.
    token_id = Counter(stream[1] for stream in plain).most_common(1)[0][0]
    engine.speculator = Speculator(FixedProposer(token_id), SpeculativeConfig(num_tokens=3))
    first = _sampled_streams(engine, prompts)
    second = _sampled_streams(engine, prompts)
    assert first == second
    assert engine.speculator.num_proposed_tokens > 0
