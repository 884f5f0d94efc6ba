"""The settings and the command of `densa bench step-bytes`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BENCH_KV_CACHE_MEMORY,
    BenchmarkCommand,
    option,
)


@dataclass(frozen=True)
class StepBytesSettings:
    concurrency: int = option(32, "requests in the run")
    prompt_len: int = option(512, "prompt tokens per request")
    output_len: int = option(64, "output tokens (EOS ignored)")
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.concurrency, self.prompt_len, self.output_len) < 1:
            raise ValueError("concurrency, prompt and output lengths must be >= 1")


BENCHMARK = BenchmarkCommand(
    name="step-bytes",
    help="bytes per step of the scheduler -> runner contract: deltas vs whole snapshots",
    description="One run of --concurrency requests; every step's SchedulerOutput encoded "
    "with msgpack, next to the whole per-request snapshot the previous contract sent.",
    settings=StepBytesSettings,
    out=Path("docs/benchmarks/step_bytes"),
    runner="densa_bench.step_bytes.runner:run_step_bytes",
    engine_defaults={"kv_cache_memory": BENCH_KV_CACHE_MEMORY},
)
