"""The settings and the command of `densa bench hostile`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BENCH_KV_CACHE_MEMORY,
    BenchmarkCommand,
    option,
)


@dataclass(frozen=True)
class HostileSettings:
    # concurrent oversized-prompt clients during a hostile phase
    num_hostile: int = option(8, flag="--hostile-clients")
    hostile_bytes: int = option(4_000_000, "text per hostile prompt")  # text per oversized prompt
    requests_per_phase: int = option(8)  # normal requests per phase
    repeats: int = option(3, "quiet + hostile phase pairs")  # quiet + hostile phase pairs
    max_tokens: int = 16  # of each normal request

    def __post_init__(self) -> None:
        if min(self.num_hostile, self.hostile_bytes, self.requests_per_phase, self.repeats) < 1:
            raise ValueError("every hostile-benchmark setting must be >= 1")


BENCHMARK = BenchmarkCommand(
    name="hostile",
    help="a normal request's latency while oversized prompts keep arriving",
    description="Quiet and hostile phases, interleaved: a client sends short chat requests "
    "one after another while (in hostile phases) other processes keep sending prompts far "
    "too long for the context. Reports the latency ratio and what the hostile ones got.",
    settings=HostileSettings,
    out=Path("docs/benchmarks/hostile"),
    runner="densa_bench.hostile.runner:run_hostile_bench",
    engine_defaults={"kv_cache_memory": BENCH_KV_CACHE_MEMORY},
)
