"""The settings and the command of `densa bench structured`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BENCH_KV_CACHE_MEMORY,
    BenchmarkCommand,
    option,
)


@dataclass(frozen=True)
class StructuredSettings:
    concurrency: tuple[int, ...] = option((1, 8), "requests/wave")
    # a cap: every test schema's answer is shorter
    max_tokens: int = option(160, "cap on each answer")
    repeats: int = option(3, "timed waves per variant and level")

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be >= 1")
        if self.repeats < 1 or self.max_tokens < 8:
            raise ValueError("repeats must be >= 1 and max_tokens >= 8")


BENCHMARK = BenchmarkCommand(
    name="structured",
    help="cost of grammar-constrained decoding (JSON schemas) per decode step",
    description="Waves of JSON-schema-constrained chat requests: token-bitmask fill and "
    "apply time as a share of the decode step, interleaved with unconstrained waves; "
    "grammar compile times cold and cached.",
    settings=StructuredSettings,
    out=Path("docs/benchmarks/structured"),
    runner="densa_bench.structured.runner:run_structured",
    engine_defaults={"kv_cache_memory": BENCH_KV_CACHE_MEMORY},
)
