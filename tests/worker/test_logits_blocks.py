"""A step samples its requests a block of rows at a time (worker/model_runner.py,
LOGITS_ROWS_AT_ONCE), computing only that block's logits: the tokens and logprobs are exactly
those of one block holding every row, for greedy, seeded random (top-k, top-p, penalties) and
verifying requests, and no call of the output head sees more rows than a block."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from densa.cache.integrity import IntegrityViolation
from densa.config import SpeculativeConfig
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.spec.proposer import SpecInput, TargetRows
from densa.spec.speculator import Speculator
from densa.worker import model_runner

NUM_PROPOSED = 2  # a verifying request samples 1 + 2 rows
PARAMS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=8, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.8, top_p=0.9, seed=12, max_tokens=8, ignore_eos=True,
                   presence_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=14, max_tokens=8, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.05, seed=16, max_tokens=8, ignore_eos=True),
]  # fmt: skip


class RepeatLast:
    """Proposes the request's last token NUM_PROPOSED times: some accepted, most rejected."""

    name = "repeat-last"
    cost_per_token = 0.0
    catch_up_cost_per_token = 0.0
    needs_hidden_states = False
    prompt_states = None

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        return [[item.token_ids[-1]] * min(NUM_PROPOSED, item.num_tokens) for item in inputs]

    def release(self, request_id: str) -> None:
        return None

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        return None

    def take_violations(self) -> list[IntegrityViolation]:
        return []  # it keeps no pages of its own


def _generate(
    model_dir: Path, speculate: bool, head_rows: list[int]
) -> tuple[list[list[int]], list[list[Any]]]:
    engine = LLMEngine.from_args(EngineArgs(model=str(model_dir), max_model_len=128,
                                            num_kv_pages=200, page_size=4, max_num_seqs=8))  # fmt: skip
    if speculate:
        config = SpeculativeConfig(num_tokens=NUM_PROPOSED, max_batch=len(PARAMS))
        engine.speculator = Speculator(RepeatLast(), config)
    head = engine.runner.model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        head_rows.append(hidden.shape[0])
        return head(hidden)

    engine.runner.model.compute_logits = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(5)
    ids = [
        engine.add_request(torch.randint(100, 40000, (5 + 3 * i,), generator=gen).tolist(), params)
        for i, params in enumerate(PARAMS)
    ]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[Any]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            tokens[delta.request_id].extend(delta.new_token_ids)
            logprobs[delta.request_id].extend(delta.new_logprobs)
    if speculate:
        assert engine.speculator is not None and engine.speculator.num_proposed_tokens > 0
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


@pytest.mark.parametrize("speculate", [False, True], ids=["decode", "verify"])
def test_blocks_of_rows_sample_what_one_block_samples(
    tiny_model_dir: Path, speculate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole_rows: list[int] = []
    monkeypatch.setattr(model_runner, "LOGITS_ROWS_AT_ONCE", 1000)
    reference = _generate(tiny_model_dir, speculate, whole_rows)
    block_rows: list[int] = []
    monkeypatch.setattr(model_runner, "LOGITS_ROWS_AT_ONCE", 1 + NUM_PROPOSED)
    blocks = _generate(tiny_model_dir, speculate, block_rows)
    assert blocks == reference  # tokens and logprobs (ids, values, top lists), exactly
    assert max(whole_rows) > 1 + NUM_PROPOSED  # the reference did hold more rows at once
    assert max(block_rows) <= 1 + NUM_PROPOSED
    assert sum(block_rows) == sum(whole_rows)  # every row computed once, nothing twice
