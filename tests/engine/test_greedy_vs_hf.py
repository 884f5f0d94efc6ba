"""densa's greedy tokens equal Hugging Face transformers' on the same weights (fp32), alone and in
a 16-request batch with tiny pages, chunked prefill and preemption; and do not depend on the batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.text.tokenizer import Tokenizer

from .reference import ReferenceGeneration, first_divergence, hf_greedy, run_with_invariants

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "A haiku about autumn leaves:\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "List of prime numbers: 2, 3, 5, 7,",
    "Photosynthesis is the process by which plants",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "SELECT name, age FROM users WHERE",
    "Q: What is 12 times 12?\nA:",
    "Machine learning models are trained by",
    "The French word for 'cat' is",
]
MAX_NEW = 24


def _prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_dir(model_dir)
    # Vary the lengths a lot: from 5 tokens to ~90 (several budget-sized chunks).
    return [tokenizer.encode(t * (1 + (i % 4) * 3)) for i, t in enumerate(TEXTS)]


def _assert_matches(
    ours: list[list[int]], refs: list[ReferenceGeneration], min_identical: int
) -> None:
    divergences = [first_divergence(mine, ref) for mine, ref in zip(ours, refs, strict=True)]
    identical = sum(d is None for d in divergences)
    assert identical >= min_identical, (
        f"only {identical}/{len(ours)} identical; divergences at {divergences}"
    )


@pytest.fixture(scope="module")
def tiny_case(tiny_model_dir: Path) -> tuple[list[list[int]], list[ReferenceGeneration]]:
    prompts = _prompts(tiny_model_dir)
    return prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


def _engine(model_dir: Path, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = dict(
        model=str(model_dir), max_model_len=512, num_kv_pages=512, page_size=16
    )
    settings.update(overrides)
    return LLMEngine.from_args(EngineArgs(**settings))  # type: ignore[arg-type]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_tiny_model_alone_matches_hf(tiny_model_dir: Path, tiny_case) -> None:  # type: ignore[no-untyped-def]
    prompts, refs = tiny_case
    engine = _engine(tiny_model_dir)
    ours = [run_with_invariants(engine, [p], GREEDY)[0] for p in prompts]
    _assert_matches(ours, refs, min_identical=len(prompts) - 1)


def test_tiny_model_alone_with_chunked_prefill_matches_hf(tiny_model_dir: Path, tiny_case) -> None:  # type: ignore[no-untyped-def]
    """One request at a time, its prompt computed in chunks of 7 tokens over pages of 4: every
    chunk after the first attends to K/V that earlier steps left in the pages."""
    prompts, refs = tiny_case
    engine = _engine(tiny_model_dir, page_size=4, max_num_batched_tokens=7)
    long = [i for i, p in enumerate(prompts) if len(p) > 3 * 7]
    assert len(long) >= 4, "the test must chunk prefills"
    ours = [run_with_invariants(engine, [prompts[i]], GREEDY)[0] for i in long]
    _assert_matches(ours, [refs[i] for i in long], min_identical=len(long) - 1)


def test_tiny_model_batch_with_chunking_and_preemption_matches_hf(
    tiny_model_dir: Path,
    tiny_case,  # type: ignore[no-untyped-def]
) -> None:
    prompts, refs = tiny_case
    # Pages of 2 tokens, 16 tokens per step, and room for ~3 of the 16 requests at once.
    engine = _engine(
        tiny_model_dir, page_size=2, num_kv_pages=160, max_num_batched_tokens=16, max_model_len=256
    )
    ours = run_with_invariants(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert max(len(p) for p in prompts) > 16, "the test must exercise chunked prefill"
    _assert_matches(ours, refs, min_identical=len(prompts) - 1)


def test_output_does_not_depend_on_batch_composition(tiny_model_dir: Path, tiny_case) -> None:  # type: ignore[no-untyped-def]
    prompts, _ = tiny_case
    engine = _engine(tiny_model_dir, page_size=4)
    alone = run_with_invariants(engine, [prompts[3]], GREEDY)[0]
    for others in (prompts[:3], prompts[4:12]):
        batch = run_with_invariants(engine, [*others, prompts[3]], GREEDY)
        assert batch[-1] == alone


@pytest.mark.slow
def test_smollm2_batch_matches_hf(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    chats = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TEXTS[:12]]
    refs = hf_greedy(smollm2_dir, chats, MAX_NEW)
    engine = _engine(
        smollm2_dir, page_size=4, num_kv_pages=64, max_num_batched_tokens=64, max_model_len=256
    )
    ours = run_with_invariants(engine, chats, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    _assert_matches(ours, refs, min_identical=10)
