"""Batch invariance: a greedy request gets the same tokens, and the same logprobs bit for bit,
alone and inside batches of 2..32 requests, for every weight and KV format the CPU kernels run.

In a batch the request's prompt shares its prefill step with other prompts, and its decode
steps with other decodes and with prompts that arrive while it decodes (mixed steps). Its prompt
is first in the queue, so it is one chunk in every run: with FP8 / INT8 pages where a prompt's
chunks end is part of what it computes (a chunk reads itself unquantized; docs/architecture.md,
"Batch invariance"); with float32 / bf16 pages it is not (tested below). Prefix caching is off:
a hit reads the prompt back from quantized pages.

The model is a tiny Llama with one KV head, so that on 2 threads decode splits the request's
long context into parts (the C++ step from 256 tokens, the Numba kernel from 512), as it would
when alone: how a context is split must not depend on the batch either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from densa.engine.hooks import StepRecord
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from tests.conftest import make_tiny_llama

TARGET_LEN = 500  # + 24 generated: the context crosses both kernels' split thresholds
NUM_TOKENS = 24
WEIGHT_FORMATS = ["dense", "w4a8", "w8a8", "w8", "int4", "fp8"]
KV_FORMATS = ["float32", "bfloat16", "fp8_e4m3", "int8"]
# What the request shared its steps with, as recorded by `_Shares`.
PREFILL_WITH_PROMPTS, DECODE_WITH_DECODES, DECODE_WITH_PROMPTS = "pp", "dd", "dp"


@dataclass(frozen=True)
class Other:
    arrival_step: int  # 0: queued right behind the request, so it shares its prefill step
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    shared: frozenset[str]  # PREFILL_WITH_PROMPTS, ... : the kinds of steps it shared
    prompt_chunks: list[int]  # how its prompt was cut into steps


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=gen).tolist()


def _others(count: int) -> list[Other]:
    """Prompts of 5..190 tokens and 10..40 new tokens; every third queued with the request, the
    rest arriving over its first 20 decode steps."""
    return [
        Other(0 if i % 3 == 0 else 1 + (i * 7) % 20, _prompt(100 + i, 5 + (i * 37) % 186),
              10 + (i * 7) % 31)
        for i in range(count)
    ]  # fmt: skip


class _Shares:
    """Step observer: which kinds of steps the request ran in, and its prompt's chunks."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.kinds: set[str] = set()
        self.prompt_chunks: list[int] = []  # tokens per prefill step

    def __call__(self, record: StepRecord) -> None:
        chunks = {c.request_id: c for c in record.step.scheduled}
        own = chunks.pop(self.request_id, None)
        if own is not None and own.start_pos < TARGET_LEN:
            self.prompt_chunks.append(own.num_tokens)
        if own is None or not chunks:
            return
        has_prompts = any(c.num_tokens > 1 for c in chunks.values())
        if own.num_tokens == 1:
            self.kinds.add(DECODE_WITH_PROMPTS if has_prompts else DECODE_WITH_DECODES)
        elif has_prompts:
            self.kinds.add(PREFILL_WITH_PROMPTS)


def _generate(engine: LLMEngine, others: list[Other], num_ahead: int = 0) -> Generation:
    """The request's greedy tokens and their logprobs, with `others` around it; the first
    `num_ahead` of them are queued before it."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    for other in others[:num_ahead]:
        p = SamplingParams(temperature=0.0, max_tokens=other.max_tokens, ignore_eos=True)
        engine.add_request(other.prompt, p)
    others = others[num_ahead:]
    request_id = engine.add_request(_prompt(0, TARGET_LEN), params)
    shares = _Shares(request_id)
    engine.observers.add(shares)
    token_ids: list[int] = []
    logprobs: list[float] = []
    step = 0
    while engine.has_unfinished_requests():
        for other in others:
            if other.arrival_step == step:
                p = SamplingParams(temperature=0.0, max_tokens=other.max_tokens, ignore_eos=True)
                engine.add_request(other.prompt, p)
        for delta in engine.step():
            assert delta.error is None, delta.error
            if delta.request_id == request_id:
                token_ids.extend(delta.new_token_ids)
                logprobs.extend(lp.logprob for lp in delta.new_logprobs)
        step += 1
    engine.observers.remove(shares)
    engine.check_invariants()
    return Generation(token_ids, logprobs, frozenset(shares.kinds), shares.prompt_chunks)


@pytest.fixture(scope="module")
def one_kv_head_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("one-kv-head"), smollm2_dir, num_key_value_heads=1
    )


def _engine(model_dir: Path, weights: str, kv: str) -> LLMEngine:
    args = EngineArgs(
        model=str(model_dir), weight_format=weights, kv_cache_dtype=kv, max_model_len=1024,
        num_kv_pages=800, page_size=16, enable_prefix_caching=False,
    )  # fmt: skip
    return LLMEngine.from_args(args)


def _assert_invariant(engine: LLMEngine, batch_sizes: list[int]) -> None:
    alone = _generate(engine, [])
    assert len(alone.token_ids) == NUM_TOKENS and not alone.shared
    assert alone.prompt_chunks == [TARGET_LEN]
    for batch_size in batch_sizes:
        batched = _generate(engine, _others(batch_size - 1))
        assert batched.prompt_chunks == [TARGET_LEN]
        assert batched.token_ids == alone.token_ids, f"batch of {batch_size}"
        assert batched.logprobs == alone.logprobs, f"batch of {batch_size}"
        if batch_size >= 3:
            assert {
                PREFILL_WITH_PROMPTS,
                DECODE_WITH_DECODES,
                DECODE_WITH_PROMPTS,
            } <= batched.shared


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
def test_alone_and_in_a_batch_of_8(weights: str, kv: str, one_kv_head_dir: Path) -> None:
    _assert_invariant(_engine(one_kv_head_dir, weights, kv), [8])


@pytest.mark.parametrize(
    ("weights", "kv"), [("dense", "float32"), ("w4a8", "fp8_e4m3"), ("fp8", "int8")]
)
def test_alone_and_in_batches_of_2_to_32(weights: str, kv: str, one_kv_head_dir: Path) -> None:
    _assert_invariant(_engine(one_kv_head_dir, weights, kv), [2, 3, 17, 32])


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_a_prompt_cut_differently_computes_the_same(kv: str, one_kv_head_dir: Path) -> None:
    """A prompt cut into other chunks (prompts queued ahead of it take the step's budget) gets
    the same tokens and logprobs: the tiled prefill attention reduces each row in an order fixed
    by its position, and with unquantized pages nothing else depends on where its chunks end."""
    engine = _engine(one_kv_head_dir, "dense", kv)
    alone = _generate(engine, [])
    behind = _generate(engine, _others(17), num_ahead=4)
    assert len(behind.prompt_chunks) > 1
    assert (behind.token_ids, behind.logprobs) == (alone.token_ids, alone.logprobs)


# The tests above run the best path this CPU has (AVX-512 VNNI here); these the other one.
@pytest.mark.parametrize("forced_isa", ["avx2"], indirect=True)
@pytest.mark.parametrize(("weights", "kv"), [("dense", "bfloat16"), ("w8a8", "int8")])
def test_the_avx2_path_too(forced_isa: str, weights: str, kv: str, one_kv_head_dir: Path) -> None:
    _assert_invariant(_engine(one_kv_head_dir, weights, kv), [8])
