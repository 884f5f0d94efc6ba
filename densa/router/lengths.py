"""Expected output length: what a request will probably add to its worker's KV and decode load.

A request that names max_tokens cannot write more; most write less, so the router keeps, per
route (endpoint and model), a running mean of the output lengths of finished requests and
expects min(max_tokens, mean). Before any request has finished on a route, it expects
max_tokens, or `default_tokens` when the request names none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_EXPECTED_TOKENS = 256
_SMOOTHING = 0.1  # weight of the newest observation in the exponential moving average


@dataclass
class LengthEstimator:
    default_tokens: int = DEFAULT_EXPECTED_TOKENS
    _means: dict[str, float] = field(default_factory=dict)

    def expect(self, route: str, max_tokens: int | None) -> int:
        mean = self._means.get(route)
        if mean is None:
            return max_tokens if max_tokens is not None else self.default_tokens
        expected = max(round(mean), 1)
        return min(expected, max_tokens) if max_tokens is not None else expected

    def observe(self, route: str, num_output_tokens: int) -> None:
        mean = self._means.get(route)
        value = float(num_output_tokens)
        self._means[route] = value if mean is None else mean + _SMOOTHING * (value - mean)

    def mean(self, route: str) -> float | None:
        return self._means.get(route)
