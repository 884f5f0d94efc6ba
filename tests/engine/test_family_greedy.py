"""Every non-Llama family, as a tiny random model, generates transformers' greedy tokens (fp32)
through the whole engine: alone, and batched with 2-token pages, chunked prefill and preemption;
with an FP8 KV cache the tokens stay close (quantization may flip late near-ties)."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.text.tokenizer import Tokenizer
from tests.tiny_families import CONFIGS, HYBRID, save_tiny

from .reference import ReferenceGeneration, first_divergence, hf_greedy, run_with_invariants

# deepseek_v3_yarn differs from deepseek_v3 only in its RoPE table and query projection, which
# the logits tests (tests/model/test_moe_families.py) cover; the engine path is the same. The
# sparse-attention families have their own, longer prompts: tests/engine/test_sparse_greedy.py.
FAMILIES = sorted(set(CONFIGS) - HYBRID - {"deepseek_v3_yarn", "deepseek_v32", "glm_moe_dsa"})

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "List of prime numbers: 2, 3, 5, 7,",
    "SELECT name, age FROM users WHERE",
    "Q: What is 12 times 12?\nA:",
]
MAX_NEW = 12
FP8_TIE_TOLERANCE = 0.1  # logit gap FP8 KV rounding can close (logits here span ~10)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
Case = tuple[Path, list[list[int]], list[ReferenceGeneration]]


@pytest.fixture(scope="module", params=FAMILIES)
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Case:
    family = request.param
    model_dir = save_tiny(family, tmp_path_factory.mktemp(family), smollm2_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    # 5 to ~60 tokens: several 16-token chunks, and longer than Gemma's 8-token window.
    prompts = [tokenizer.encode(t * (1 + (i % 4) * 2)) for i, t in enumerate(TEXTS)]
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


def _engine(model_dir: Path, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = dict(
        model=str(model_dir), max_model_len=256, num_kv_pages=256, page_size=16
    )
    return LLMEngine.from_args(EngineArgs(**(settings | overrides)))  # type: ignore[arg-type]


def _num_identical(ours: list[list[int]], refs: list[ReferenceGeneration]) -> int:
    return sum(first_divergence(o, r) is None for o, r in zip(ours, refs, strict=True))


def test_alone_matches_hf(case: Case) -> None:
    model_dir, prompts, refs = case
    engine = _engine(model_dir)
    ours = [run_with_invariants(engine, [p], GREEDY)[0] for p in prompts[3:5]]  # 2 chunks, 1
    assert _num_identical(ours, refs[3:5]) == 2


def test_batch_with_chunking_and_preemption_matches_hf(case: Case) -> None:
    model_dir, prompts, refs = case
    # Pages of 2 tokens, 16 tokens per step, room for about two of the eight requests at once.
    engine = _engine(
        model_dir, page_size=2, num_kv_pages=80, max_num_batched_tokens=16, max_model_len=128
    )
    ours = run_with_invariants(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert max(len(p) for p in prompts) > 16, "the test must exercise chunked prefill"
    assert _num_identical(ours, refs) >= len(prompts) - 1


def test_fp8_kv_stays_close_to_hf(case: Case) -> None:
    model_dir, prompts, refs = case
    engine = _engine(model_dir, page_size=4, kv_cache_dtype="fp8_e4m3")
    ours = run_with_invariants(engine, prompts, GREEDY)
    # e4m3 keeps 3 mantissa bits: a generation may leave HF's only where HF's top two logits
    # were within FP8's error of each other, and most generations must not leave it at all.
    for mine, ref in zip(ours, refs, strict=True):
        idx = next(
            (i for i, (a, b) in enumerate(zip(mine, ref.token_ids, strict=True)) if a != b), None
        )
        if idx is not None:
            gap = float(ref.scores[idx][ref.token_ids[idx]] - ref.scores[idx][mine[idx]])
            assert gap < FP8_TIE_TOLERANCE, f"token {idx}: FP8 KV flipped a clear choice ({gap})"
    identical = sum(mine == ref.token_ids for mine, ref in zip(ours, refs, strict=True))
    assert identical >= len(prompts) // 2
