"""Greedy output with speculation is the output without it, token for token and logprob for
logprob (bit for bit): each proposal is verified as a decode row of its own (docs/speculative.md),
so accepted tokens are computed exactly as sequential decode steps would compute them.

A scripted proposer knows the non-speculative output and proposes it with every third token
wrong, so every run accepts long runs and rejects (and rolls back) often; the n-gram proposer
runs on the bundled SmolLM2-135M with a prompt that repeats itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
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

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


@dataclass
class Generated:
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    num_preemptions: int


class ScriptedProposer:
    """Proposes the reference continuation, with the token at every position divisible by 3
    replaced by its neighbour id (a certain rejection)."""

    name = "scripted"
    cost_per_token = 0.0
    catch_up_cost_per_token = 0.0
    needs_hidden_states = False
    prompt_states = None

    def __init__(self) -> None:
        self.full: dict[str, list[int]] = {}  # request id -> prompt + reference output
        self.released: list[str] = []

    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        proposals = []
        for item in inputs:
            full, start = self.full[item.request_id], len(item.token_ids)
            assert list(item.token_ids) == full[:start], "proposals come after accepted tokens"
            proposals.append(
                [t + 1 if p % 3 == 0 else t for p, t in enumerate(full) if start <= p][
                    : item.num_tokens
                ]
            )
        return proposals

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        return None

    def take_violations(self) -> list[IntegrityViolation]:
        return []


def _prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(100, 40000, (9 + 7 * i,), generator=gen).tolist() for i in range(count)]


def _generate(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> Generated:
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    preemptions_before = engine.scheduler.num_preemptions
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            tokens[delta.request_id].extend(delta.new_token_ids)
            logprobs[delta.request_id].extend(lp.logprob for lp in delta.new_logprobs)
        engine.check_invariants()
    assert sum(engine.integrity_stats.counts.values()) == 0
    return Generated(
        [tokens[i] for i in ids],
        [logprobs[i] for i in ids],
        engine.scheduler.num_preemptions - preemptions_before,
    )


def _engine(model_dir: Path | None, **overrides: object) -> LLMEngine:
    args = EngineArgs(
        model=None if model_dir is None else str(model_dir), max_model_len=256, num_kv_pages=300,
        page_size=4, max_num_seqs=8,
    )  # fmt: skip
    return LLMEngine.from_args(replace(args, **overrides))  # type: ignore[arg-type]


def _speculate(engine: LLMEngine, reference: Generated, prompts: list[list[int]]) -> None:
    proposer = ScriptedProposer()
    for i, (prompt, output) in enumerate(zip(prompts, reference.token_ids, strict=True)):
        proposer.full[f"r{i}"] = prompt + output
    engine.speculator = Speculator(proposer, SpeculativeConfig(num_tokens=4))


def _assert_same(engine: LLMEngine, prompts: list[list[int]], reference: Generated) -> None:
    _speculate(engine, reference, prompts)
    speculative = _generate(engine, prompts)
    assert speculative.token_ids == reference.token_ids
    assert speculative.logprobs == reference.logprobs  # bit for bit
    assert engine.speculator is not None
    assert 0 < engine.speculator.num_accepted_tokens < engine.speculator.num_proposed_tokens
    engine.speculator = None


@pytest.mark.parametrize(
    ("fused", "kv"), [(True, "float32"), (False, "float32"), (True, "fp8_e4m3")],
    ids=["fused-fp32", "eager-fp32", "fused-fp8"],
)  # fmt: skip
def test_tiny_model_in_a_batch_with_prefix_caching(
    tiny_model_dir: Path, fused: bool, kv: str
) -> None:
    engine = _engine(tiny_model_dir, fused_decode=fused, kv_cache_dtype=kv)
    prompts = _prompts(3)
    # A prompt served from the prefix cache is computed in other chunks than a cold one, which
    # is not bit-identical (docs/architecture.md, "Batch invariance"): compare cold with cold
    # and warm with warm.
    cold = _generate(engine, prompts)
    warm = _generate(engine, prompts)
    engine.kv_manager.reset_prefix_cache()
    _assert_same(engine, prompts, cold)
    assert engine.kv_manager.num_hit_tokens > 0
    _assert_same(engine, prompts, warm)


def test_tiny_model_alone(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, enable_prefix_caching=False)
    prompts = _prompts(1)
    _assert_same(engine, prompts, _generate(engine, prompts))


def test_tiny_model_with_preemption(tiny_model_dir: Path) -> None:
    # 64 pages hold one 256-token request; six of ~50 tokens need 76: some are preempted.
    engine = _engine(tiny_model_dir, num_kv_pages=64, enable_prefix_caching=False)
    prompts = _prompts(6)
    reference = _generate(_engine(tiny_model_dir, enable_prefix_caching=False), prompts)
    _speculate(engine, reference, prompts)
    speculative = _generate(engine, prompts)
    assert speculative.num_preemptions > 0
    assert speculative.token_ids == reference.token_ids
    # A preempted request recomputes its tokens as a prompt chunk, which rounds differently
    # from the decode steps that first computed them (with or without speculation, and the
    # two runs preempt at different steps): the same tokens, logprobs equal to float32 noise.
    for ours, theirs in zip(speculative.logprobs, reference.logprobs, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_ngram_on_smollm2_with_a_repeating_prompt() -> None:
    engine = _engine(None, max_model_len=512, num_kv_pages=600, enable_prefix_caching=False)
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3
    prompts = [
        engine.tokenizer.encode(text),
        engine.tokenizer.encode("The capital of France is Paris. The capital of Italy is"),
    ]
    reference = _generate(engine, prompts, replace(GREEDY, max_tokens=24))
    engine.speculator = Speculator(_ngram(), SpeculativeConfig(num_tokens=4))
    speculative = _generate(engine, prompts, replace(GREEDY, max_tokens=24))
    assert speculative.token_ids == reference.token_ids
    assert speculative.logprobs == reference.logprobs
    assert engine.speculator.num_accepted_tokens > 0  # proposals were accepted, not only made


def _ngram():  # type: ignore[no-untyped-def]
    from densa.spec.ngram import NgramProposer

    return NgramProposer()
