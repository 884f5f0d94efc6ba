"""--deterministic: a greedy request's tokens and logprobs are bit-identical whatever else shares
its steps, however its prompt is cut into chunks, and whether its prompt was found in the
prefix cache (in full, in part, or not at all), for every weight and KV format the mode runs.

Default mode is batch-invariant (tests/engine/test_batch_invariance.py) but not chunk- or
cache-invariant on FP8 / INT8 pages: a chunk attends to itself unquantized while a prefix hit
reads the prompt back quantized, so where chunks end changes what a row reads (the first test
shows both). In deterministic mode every row, prefill or decode, attends through the tiled
kernel reading every position from the pages (model/fused_decode.py step_sequences).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from tests.conftest import make_tiny_llama

PROMPT_LEN = 300
NUM_TOKENS = 12
SHARED_LEN = 200  # a second prompt's first tokens, the same as the first's


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    logprobs: list[float]
    num_cached_tokens: int


def _tokens(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=gen).tolist()


PROMPT = _tokens(0, PROMPT_LEN)
PARTLY_SHARED = PROMPT[:SHARED_LEN] + _tokens(1, 90)
OTHERS = [_tokens(10 + i, 20 + 37 * i) for i in range(7)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    # One KV head: on 2 threads decode splits long contexts (the C++ step from 256 tokens).
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_dir, num_key_value_heads=1)


def _engine(model_dir: Path, weights: str, kv: str, budget: int, deterministic: bool) -> LLMEngine:
    args = EngineArgs(
        model=str(model_dir), weight_format=weights, kv_cache_dtype=kv, max_model_len=1024,
        num_kv_pages=400, page_size=16, max_num_batched_tokens=budget,
        deterministic=deterministic,
    )  # fmt: skip
    return LLMEngine.from_args(args)


def _run(
    engine: LLMEngine, prompt: list[int], others: list[list[int]] = (), scope: str = ""
) -> Answer:
    """The greedy answer to `prompt`, queued behind `others` (which take the step's budget, so
    its prompt is cut into other chunks, and share its decode steps)."""
    for other in others:
        engine.add_request(other, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    request_id = engine.add_request(prompt, params, cache_scope=scope)
    token_ids: list[int] = []
    logprobs: list[float] = []
    cached = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            if delta.request_id == request_id:
                token_ids += delta.new_token_ids
                logprobs += [lp.logprob for lp in delta.new_logprobs]
                cached = delta.num_cached_tokens
    engine.check_invariants()
    return Answer(token_ids, logprobs, cached)


def _same(a: Answer, b: Answer) -> bool:
    return (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)


def test_default_mode_depends_on_chunks_and_cache(tiny_dir: Path) -> None:
    """Why the mode exists (on INT8 pages): a cache hit and another chunking change logprobs."""
    one_chunk = _engine(tiny_dir, "dense", "int8", 512, deterministic=False)
    cold = _run(one_chunk, PROMPT)
    hit = _run(one_chunk, PROMPT)
    assert hit.num_cached_tokens > 0 and not _same(cold, hit)
    chunked = _run(_engine(tiny_dir, "dense", "int8", 64, deterministic=False), PROMPT)
    assert not _same(cold, chunked)


@pytest.mark.parametrize(
    ("weights", "kv"),
    [("dense", "float32"), ("dense", "int8"), ("w4a8", "fp8_e4m3"), ("w8", "bfloat16")],
)  # fmt: skip
def test_the_same_bits_whatever_the_batch_chunks_and_cache(
    tiny_dir: Path, weights: str, kv: str
) -> None:
    one_chunk = _engine(tiny_dir, weights, kv, 512, deterministic=True)
    cold = _run(one_chunk, PROMPT)
    assert len(cold.token_ids) == NUM_TOKENS and cold.num_cached_tokens == 0
    full_hit = _run(one_chunk, PROMPT)
    assert full_hit.num_cached_tokens == PROMPT_LEN // 16 * 16
    assert _same(cold, full_hit)
    # In 64-token chunks, behind and beside seven other requests, in a scope of its own (cold).
    chunked = _engine(tiny_dir, weights, kv, 64, deterministic=True)
    batched = _run(chunked, PROMPT, OTHERS, scope="other tenant")
    assert batched.num_cached_tokens == 0 and _same(cold, batched)
    # A prompt that shares its first 200 tokens: cold, then after PROMPT cached them.
    alone = _run(chunked, PARTLY_SHARED, scope="fresh")
    partial_hit = _run(one_chunk, PARTLY_SHARED)
    assert alone.num_cached_tokens == 0 and partial_hit.num_cached_tokens == SHARED_LEN // 16 * 16
    assert _same(alone, partial_hit)


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_a_generated_token_computes_as_the_same_prompt_row(tiny_dir: Path, kv: str) -> None:
    """A session's next turn reads its earlier answer as prompt: the answer's tokens, computed
    by decode steps, must compute the same bits as prompt rows (cold, in one chunk)."""
    engine = _engine(tiny_dir, "dense", kv, 512, deterministic=True)
    first = _run(engine, PROMPT)
    cold = _engine(tiny_dir, "dense", kv, 512, deterministic=True)
    replay = _run(cold, PROMPT + first.token_ids[:5])  # rows 300..304 as one prefill chunk
    assert replay.num_cached_tokens == 0
    assert replay.token_ids[:5] == first.token_ids[5:10]
    assert replay.logprobs[:5] == first.logprobs[5:10]


@pytest.mark.parametrize("forced_isa", ["avx2"], indirect=True)
def test_the_avx2_path_too(forced_isa: str, tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, "w4a8", "int8", 512, deterministic=True)
    cold = _run(engine, PROMPT)
    chunked = _run(_engine(tiny_dir, "w4a8", "int8", 64, deterministic=True), PROMPT, OTHERS)
    assert _same(cold, _run(engine, PROMPT)) and _same(cold, chunked)


@pytest.mark.parametrize(
    ("overrides", "why"),
    [({"fused_decode": False}, "--no-fused-decode was given"),
     ({"attention_backend": "torch"}, "'torch' attention backend"),
     ({"weight_format": "int4"}, "has no fused-decode form")],
)  # fmt: skip
def test_what_the_mode_cannot_run_is_refused_at_start_up(
    tiny_dir: Path, overrides: dict[str, object], why: str
) -> None:
    settings: dict[str, object] = {"model": str(tiny_dir), "max_model_len": 256,
                                   "num_kv_pages": 64, "deterministic": True}  # fmt: skip
    with pytest.raises(ValueError, match="--deterministic needs the fused C") as info:
        LLMEngine.from_args(EngineArgs(**(settings | overrides)))  # type: ignore[arg-type]
    assert why in str(info.value)
