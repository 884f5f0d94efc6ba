"""What a serving benchmark records per request and per wave; the protocol engines under test meet.

All times are `time.perf_counter()` seconds taken on the caller's side of the engine: a token
counts as arrived when the engine hands it back, which is when a client could see it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Protocol


@dataclass
class RequestTiming:
    """One request's submit time and the arrival time of each of its output tokens."""

    submit_s: float
    token_s: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (must stay 0 here)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_s)

    @property
    def ttft_s(self) -> float:
        """Time to first token: submit -> first output token (queueing + prefill)."""
        return self.token_s[0] - self.submit_s

    @property
    def e2e_s(self) -> float:
        return self.token_s[-1] - self.submit_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (tokens - 1); None for 1 token."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gap before each token after the first."""
        return [later - earlier for earlier, later in pairwise(self.token_s)]


@dataclass
class Wave:
    """One timed wave: who ran it, with what, and every request's timing."""

    engine: str
    concurrency: int
    repeat_idx: int
    prompt_len: int
    wall_s: float
    requests: list[RequestTiming]
    peak_rss_bytes: int
    start_rss_bytes: int
    engine_stats: dict[str, int]

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.wall_s


class ServingEngine(Protocol):
    """An engine under test. `run_wave` submits every prompt at once and returns when all are done.

    It must produce exactly `output_len` tokens per prompt (EOS ignored), greedily, and may keep
    state (weights, caches, allocators) between waves: that is what warm-up is for.
    """

    name: str

    def run_wave(self, prompts: list[list[int]], output_len: int) -> list[RequestTiming]: ...

    def wave_stats(self) -> dict[str, int]:
        """Engine-specific counters about the last wave (e.g. KV pages), for the raw samples."""
        ...
