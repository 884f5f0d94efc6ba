"""Read a densa server's /metrics back into numbers (load benchmark, tests, the router to come).

Torch-free on purpose: a router process imports this without loading an engine.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


class MetricSamples:
    """Every sample of one scrape, by sample name (e.g. `densa_requests_total`) and labels."""

    def __init__(self, text: str) -> None:
        self._samples: dict[str, dict[Labels, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                self._samples.setdefault(sample.name, {})[labels] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The sum over every sample of `name` whose labels include `labels` (0 if none)."""
        wanted = labels.items()
        return sum(
            value
            for sample_labels, value in self._samples.get(name, {}).items()
            if wanted <= dict(sample_labels).items()
        )

    def by_label(self, name: str, label: str) -> Mapping[str, float]:
        """`name` summed per value of one label, e.g. requests per outcome."""
        totals: dict[str, float] = {}
        for sample_labels, value in self._samples.get(name, {}).items():
            key = dict(sample_labels).get(label, "")
            totals[key] = totals.get(key, 0.0) + value
        return totals


def scrape(base_url: str, timeout: float = 10.0) -> MetricSamples:
    response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout)
    response.raise_for_status()
    return MetricSamples(response.text)
