"""Greedy generations: token-identical counts and the first divergence."""

from __future__ import annotations

import pytest

from densa.engine.llm import LLM
from densa.sampling_params import SamplingParams
from densa_bench.eval.greedy import (
    DEFAULT_PROMPTS,
    GreedyComparison,
    GreedySettings,
    compare_greedy,
    first_divergence,
)
from densa_bench.eval.stats import Bootstrap, proportion_ci


@pytest.mark.parametrize(
    ("ref", "test", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([4, 2], [1, 2], 0),
        ([1, 2], [1, 2, 3], 2),  # the reference stopped (EOS) where the test went on
        ([], [5], 0),
    ],
)
def test_first_divergence(ref: list[int], test: list[int], expected: int | None) -> None:
    assert first_divergence(ref, test) == expected


def test_identical_formats_generate_identical_tokens(tiny_llms: dict[str, LLM]) -> None:
    llms = {"ref": tiny_llms["ref"], "same": tiny_llms["same"]}
    ref_out, (same,) = compare_greedy(llms, DEFAULT_PROMPTS[:3], max_tokens=6)
    assert same.token_ids == ref_out and all(len(ids) == 6 for ids in ref_out)
    assert (same.num_identical, same.mean_first_divergence) == (3, None)


def test_settings_are_checked() -> None:
    assert len(GreedySettings().selected_prompts) == 20
    with pytest.raises(ValueError, match="num_prompts"):
        GreedySettings(num_prompts=len(DEFAULT_PROMPTS) + 1)


def test_comparison_intervals_count_prompts_and_matched_tokens() -> None:
    c = GreedyComparison("t", [], [], first_divergence=[None, 3, 0, None], ref_lengths=[8, 8, 5, 6])
    assert c.matched_tokens == [8, 3, 0, 6]
    mean = c.mean_matched_tokens(Bootstrap(num_resamples=200))
    assert mean.value == 17 / 4 and 0 <= mean.low <= mean.value <= mean.high <= 8
    share = c.identical_share()
    assert share.value == 0.5 and 0.15 < share.low < 0.5 < share.high < 0.85


def test_wilson_interval_is_not_empty_at_the_edges() -> None:
    none, all_ = proportion_ci(0, 20), proportion_ci(20, 20)
    assert (none.value, none.low) == (0.0, 0.0) and 0.15 < none.high < 0.17  # 16.1%
    assert (all_.value, all_.high) == (1.0, 1.0) and 0.83 < all_.low < 0.85
    assert proportion_ci(1, 20).format(".1f", scale=100) == "5.0 [0.9, 23.6]"
    with pytest.raises(ValueError):
        proportion_ci(3, 2)


def test_generate_reports_each_finished_request(tiny_llms: dict[str, LLM]) -> None:
    """What evaluations count their progress with: one call per request, as it finishes."""
    finished: list[int] = []
    results = tiny_llms["ref"].generate(
        ["a", "b c", "d e f"], SamplingParams(max_tokens=3), on_finished=finished.append
    )
    assert finished == [1, 1, 1] and len(results) == 3
