"""Statistics every measurement shares: percentiles, spreads, interleaved repetitions.

How densa measures (docs: /work/shared/BENCHMARKS.md): compare configurations inside one run,
interleaved A B A B ..., report the median with the min..max spread, and name the hardware.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


# ---- statistics ------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def latency_stats(values: Sequence[float]) -> dict[str, float]:
    """Median, p95, p99, mean, min and max of latency samples (seconds in, seconds out)."""
    return {
        "median": median(values),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
        "count": len(values),
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and min..max of repeated measurements: what every comparison is reported with."""
    return {"median": median(values), "min": min(values), "max": max(values)}


def format_spread(stats: dict[str, float], digits: int = 1) -> str:
    """'12.3 (11.9..12.8)': median with the min..max spread of the repetitions."""
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}..{stats['max']:.{digits}f})"


# ---- interleaved repetitions -----------------------------------------------------------------
def interleave(variants: Sequence[T], repeats: int) -> list[tuple[int, T]]:
    """(repeat_idx, variant) pairs in the order A B A B ...: each repetition runs every variant.

    Interleaving spreads slow drift (thermal state, a neighbour's load) over every variant instead
    of letting it fall on whichever ran last.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [(repeat_idx, variant) for repeat_idx in range(repeats) for variant in variants]
