"""Bootstrap intervals and per-position divergences against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from densa_bench.eval.stats import (
    Bootstrap,
    Estimate,
    block_bootstrap,
    kl_divergence,
    mean_ci,
    paired_difference_ci,
    ratio_ci,
    target_nll,
    top1_agreement,
)

MANY = Bootstrap(num_resamples=10_000, seed=0)


def test_constant_data_has_a_zero_width_interval() -> None:
    assert mean_ci([0.5] * 10) == Estimate(0.5, 0.5, 0.5)
    assert mean_ci([2.0]) == Estimate(2.0, 2.0, 2.0)


def test_two_point_data_gives_the_exact_percentile_interval() -> None:
    # Resampled means of [0, 1] are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the 2.5th and
    # 97.5th percentiles fall inside the masses at 0 and 1.
    assert mean_ci([0.0, 1.0], MANY) == Estimate(0.5, 0.0, 1.0)


def test_paired_difference_of_identical_samples_is_exactly_zero() -> None:
    correct = [1.0, 0.0, 1.0, 1.0, 0.0]
    assert paired_difference_ci(correct, correct) == Estimate(0.0, 0.0, 0.0)


def test_paired_difference_interval_is_the_binomial_one() -> None:
    # One of four questions flips from right to wrong: diffs [0, 0, -1, 0]. The number of draws
    # of the flipped question ~ Binomial(4, 1/4): P(>= 3) = 0.051 puts the 2.5th percentile at
    # -0.75; P(0) = 0.316 puts the 97.5th at 0.
    ref, test = [1, 0, 1, 1], [1, 0, 0, 1]
    assert paired_difference_ci(ref, test, MANY) == Estimate(-0.25, -0.75, 0.0)


def test_ratio_resamples_whole_blocks() -> None:
    # Two segments of 100 tokens: KL 1 everywhere in one, 0 in the other. Resampling segments
    # sees only 0, 0.5 or 1; resampling the 200 tokens as if independent is far too confident.
    by_block = ratio_ci([100.0, 0.0], [100.0, 100.0], MANY)
    assert by_block == Estimate(0.5, 0.0, 1.0)
    by_token = mean_ci([1.0] * 100 + [0.0] * 100, MANY)
    assert by_token.high - by_token.low < 0.15


def test_interval_of_a_normal_mean_matches_the_textbook_width() -> None:
    values = np.random.default_rng(1).normal(size=10_000)
    estimate = mean_ci(values, Bootstrap(num_resamples=2000, seed=0))
    assert estimate.value == pytest.approx(values.mean())
    assert estimate.high - estimate.low == pytest.approx(2 * 1.96 / 100, rel=0.1)


def test_the_seed_fixes_the_draws() -> None:
    values = np.random.default_rng(2).normal(size=50)
    assert mean_ci(values, Bootstrap(seed=3)) == mean_ci(values, Bootstrap(seed=3))
    assert mean_ci(values, Bootstrap(seed=3)) != mean_ci(values, Bootstrap(seed=4))


def test_block_bootstrap_applies_the_statistic_to_totals() -> None:
    columns = {"ref": [math.log(2.0) * 4], "test": [math.log(3.0) * 4], "n": [4.0]}
    delta = block_bootstrap(
        columns, lambda t: np.exp(t["test"] / t["n"]) - np.exp(t["ref"] / t["n"])
    )
    assert delta.value == pytest.approx(1.0)
    assert delta.low == pytest.approx(1.0) and delta.high == pytest.approx(1.0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="one value per block"):
        ratio_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="zero blocks"):
        mean_ci([])
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference_ci([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="confidence"):
        Bootstrap(confidence=1.0)


def test_estimate_formats_with_a_scale() -> None:
    assert Estimate(0.5, 0.25, 0.75).format(".1f", scale=100) == "50.0 [25.0, 75.0]"


def _logprobs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def test_kl_divergence_of_hand_made_distributions() -> None:
    ref = _logprobs([0.5, 0.5], [0.1, 0.9])
    test = _logprobs([0.25, 0.75], [0.1, 0.9])
    # KL([.5, .5] || [.25, .75]) = .5 ln(.5/.25) + .5 ln(.5/.75) = .5 ln(4/3)
    expected = torch.tensor([0.5 * math.log(4 / 3), 0.0], dtype=torch.float64)
    torch.testing.assert_close(kl_divergence(ref, test), expected)
    # KL is not symmetric: KL([.25, .75] || [.5, .5]) = .25 ln(.5) + .75 ln(1.5)
    reverse = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert float(kl_divergence(test, ref)[0]) == pytest.approx(reverse)


def test_top1_agreement_and_target_nll() -> None:
    ref = _logprobs([0.5, 0.3, 0.2], [0.2, 0.3, 0.5])
    test = _logprobs([0.4, 0.35, 0.25], [0.5, 0.3, 0.2])
    assert top1_agreement(ref, test).tolist() == [True, False]
    nll = target_nll(ref, torch.tensor([1, 2]))
    torch.testing.assert_close(
        nll, torch.tensor([-math.log(0.3), -math.log(0.5)], dtype=torch.float64)
    )
