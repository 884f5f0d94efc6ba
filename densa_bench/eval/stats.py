"""Statistics for comparing numeric formats: bootstrap confidence intervals and divergences.

Resampling is by *block*. The caller passes, per independent unit (a text segment, a question),
the sums that unit contributes; a bootstrap resample draws whole units with replacement and
recomputes the statistic from the resampled totals. Tokens inside one text are correlated, so
resampling single tokens would make the intervals too narrow.

Intervals are percentile intervals. The same seed gives the same resampled units for every
format, so intervals of different formats come from the same draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch

DEFAULT_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95

# Maps resampled totals ({"name": [resamples] float64}) to the statistic ([resamples]).
Statistic = Callable[[Mapping[str, np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap confidence interval [low, high]."""

    value: float
    low: float
    high: float
    confidence: float = DEFAULT_CONFIDENCE

    def to_json(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}

    def format(self, spec: str = ".4f", scale: float = 1.0) -> str:
        """'0.0123 [0.0101, 0.0150]' for spec '.4f'; scale=100 shows fractions as percentages."""
        v, lo, hi = (x * scale for x in (self.value, self.low, self.high))
        return f"{v:{spec}} [{lo:{spec}}, {hi:{spec}}]"


@dataclass(frozen=True)
class Bootstrap:
    """How intervals are drawn: resamples, confidence level and the seed of the draws."""

    num_resamples: int = DEFAULT_RESAMPLES
    confidence: float = DEFAULT_CONFIDENCE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_resamples < 1:
            raise ValueError(f"num_resamples must be >= 1, got {self.num_resamples}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")


DEFAULT_BOOTSTRAP = Bootstrap()


def block_bootstrap(
    block_sums: Mapping[str, Sequence[float] | np.ndarray],
    statistic: Statistic,
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
) -> Estimate:
    """Bootstrap a statistic of per-block sums (one row per block, every column the same length).

    The point estimate is the statistic of the full totals; the interval comes from
    `bootstrap.num_resamples` resamples of whole blocks.
    """
    columns = {name: np.asarray(values, dtype=np.float64) for name, values in block_sums.items()}
    num_blocks = _num_blocks(columns)
    value = float(statistic({name: col.sum(keepdims=True) for name, col in columns.items()})[0])
    rng = np.random.default_rng(bootstrap.seed)
    block_idx = rng.integers(0, num_blocks, size=(bootstrap.num_resamples, num_blocks))
    totals = {name: col[block_idx].sum(axis=1) for name, col in columns.items()}  # [resamples]
    tail = (1 - bootstrap.confidence) / 2 * 100
    low, high = np.percentile(statistic(totals), [tail, 100 - tail])
    return Estimate(value, float(low), float(high), bootstrap.confidence)


def _num_blocks(columns: Mapping[str, np.ndarray]) -> int:
    lengths = {len(col) for col in columns.values()}
    if len(lengths) != 1:
        raise ValueError(f"every column needs one value per block, got lengths {sorted(lengths)}")
    (num_blocks,) = lengths
    if num_blocks == 0:
        raise ValueError("bootstrap of zero blocks")
    return num_blocks


def ratio_ci(
    numerators: Sequence[float] | np.ndarray,
    denominators: Sequence[float] | np.ndarray,
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
) -> Estimate:
    """sum(numerators) / sum(denominators), resampling blocks: e.g. mean per-token KL where each
    text segment contributes (the sum of its KLs, its token count)."""
    return block_bootstrap(
        {"num": numerators, "den": denominators}, lambda t: t["num"] / t["den"], bootstrap
    )


def mean_ci(
    values: Sequence[float] | np.ndarray, bootstrap: Bootstrap = DEFAULT_BOOTSTRAP
) -> Estimate:
    """The mean of independent values (e.g. 0/1 correctness per question) with its interval."""
    return ratio_ci(values, np.ones(len(values)), bootstrap)


def paired_difference_ci(
    ref: Sequence[float] | np.ndarray,
    test: Sequence[float] | np.ndarray,
    bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
) -> Estimate:
    """mean(test - ref), resampling pairs: both formats answered the same questions, so the
    per-question difference cancels question difficulty and the interval is much tighter."""
    if len(ref) != len(test):
        raise ValueError(f"paired samples differ in length: {len(ref)} vs {len(test)}")
    diffs = np.asarray(test, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
    return mean_ci(diffs, bootstrap)


def proportion_ci(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> Estimate:
    """successes / trials with its Wilson score interval. For a count of independent yes/no
    outcomes (e.g. prompts whose generation stayed identical): unlike a percentile bootstrap it
    gives a non-empty interval at 0 / n and n / n."""
    if not 0 <= successes <= trials or trials < 1:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    z = float(NormalDist().inv_cdf(0.5 + confidence / 2))
    share = successes / trials
    center = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials))
    half /= 1 + z * z / trials
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == trials else min(1.0, center + half)
    return Estimate(share, low, high, confidence)


# ---- next-token distributions ----------------------------------------------------------------
def kl_divergence(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || test) in nats per row of [n, vocab] log-probabilities -> [n].

    The expectation is under the reference: how surprised a reader who trusts the test format
    would be by the reference model's next token.
    """
    return (ref_logprobs.exp() * (ref_logprobs - test_logprobs)).sum(dim=-1)


def top1_agreement(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """[n] bool: both formats rank the same token first (greedy decoding would agree here)."""
    return ref_logprobs.argmax(dim=-1) == test_logprobs.argmax(dim=-1)


def target_nll(logprobs: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """[n] negative log-likelihood of the actual next tokens (perplexity = exp(mean))."""
    return -logprobs.gather(1, target_ids[:, None]).squeeze(1)
