"""Next-token distribution comparison through the real paged-KV path."""

from __future__ import annotations

import pytest

from densa.engine.llm import LLM
from densa_bench.eval.distribution import compare_distributions, text_segments

NUM_SEGMENTS, SEGMENT_LEN = 3, 128


@pytest.fixture(scope="module")
def segments(tiny_llms: dict[str, LLM]) -> list[list[int]]:
    return text_segments(tiny_llms["ref"].tokenizer, NUM_SEGMENTS, SEGMENT_LEN)


def test_segments_are_consecutive_windows_of_one_stream(tiny_llms: dict[str, LLM]) -> None:
    tokenizer = tiny_llms["ref"].tokenizer
    passages = ["The cat sat on the mat.", "It was a sunny day.", "Nothing else happened."]
    stream = [t for p in passages for t in tokenizer.encode(p + "\n\n", add_special_tokens=False)]
    assert text_segments(tokenizer, 2, 7, passages) == [stream[:7], stream[7:14]]
    with pytest.raises(ValueError, match="fewer than the 1000 asked for"):
        text_segments(tokenizer, 1, 1000, passages)


def test_identical_formats_agree_exactly(
    tiny_llms: dict[str, LLM], segments: list[list[int]]
) -> None:
    llms = {"ref": tiny_llms["ref"], "same": tiny_llms["same"]}
    result = compare_distributions(llms, segments, chunk_size=100)
    same = result["same"]
    assert result.num_predictions == NUM_SEGMENTS * (SEGMENT_LEN - 1)
    assert abs(same.mean_kl.value) < 1e-6 and same.kl_max < 1e-6
    assert (same.top1_agreement.value, same.top1_agreement.low) == (1.0, 1.0)
    assert same.perplexity == result.ref_perplexity
    assert (same.perplexity_delta.low, same.perplexity_delta.high) == (0.0, 0.0)


def test_a_bfloat16_kv_cache_moves_the_distributions_a_little(
    tiny_llms: dict[str, LLM], segments: list[list[int]]
) -> None:
    result = compare_distributions({"ref": tiny_llms["ref"], "bf16": tiny_llms["bf16"]}, segments)
    bf16 = result["bf16"]
    assert 0 < bf16.mean_kl.low <= bf16.mean_kl.value <= bf16.mean_kl.high < 1e-3
    assert bf16.top1_agreement.value > 0.95
    assert abs(bf16.perplexity_delta.value) < 0.01 * result.ref_perplexity.value
    for llm in tiny_llms.values():
        llm.engine.check_invariants()  # every scored page went back to the pool
