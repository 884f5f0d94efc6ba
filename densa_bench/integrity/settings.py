"""The settings and the command of `densa bench integrity`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BENCH_KV_CACHE_MEMORY,
    BenchmarkCommand,
    option,
)
from densa_bench.serving.settings import ServingSettings


@dataclass(frozen=True)
class IntegritySettings:
    concurrency: tuple[int, ...] = option((1, 2, 4, 8), "requests/wave")
    prompt_len: int = option(2048, "prompt tokens per request")
    output_len: int = option(256, "output tokens (EOS ignored)")
    repeats: int = option(3, "timed waves per variant and level")
    warmup: int = option(1, "untimed waves per variant first")
    prompt_seed: int = option(0, "seed of the random prompts")

    def __post_init__(self) -> None:
        self.serving()  # validates the shared fields

    def serving(self) -> ServingSettings:
        return ServingSettings.densa_only(self)


BENCHMARK = BenchmarkCommand(
    name="integrity",
    help="cost of KV integrity checks: on vs off, interleaved",
    description="Long-prompt, long-output waves with --kv-integrity on and off, interleaved, "
    "plus a direct timing of the batched check on the same step shapes.",
    settings=IntegritySettings,
    out=Path("docs/benchmarks/integrity"),
    runner="densa_bench.integrity.runner:run_integrity",
    engine_defaults={"kv_cache_memory": BENCH_KV_CACHE_MEMORY},
)
