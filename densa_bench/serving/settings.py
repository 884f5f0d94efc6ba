"""The settings and the command of `densa bench serving`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from densa_bench.common.benchmark import (
    BENCH_KV_CACHE_MEMORY,
    BenchmarkCommand,
    option,
)


@dataclass(frozen=True)
class ServingSettings:
    concurrency: tuple[int, ...] = option((1, 8, 32), "requests/wave")
    prompt_len: int = option(256, "prompt tokens per request")
    output_len: int = option(128, "output tokens (EOS ignored)")
    repeats: int = option(3, "timed waves per variant and level")
    # untimed waves per engine at the highest concurrency before timing starts
    warmup: int = option(1, "untimed waves per variant first")
    prompt_seed: int = option(0, "seed of the random prompts")
    include_hf: bool = option(True, "measure densa only", flag="--skip-hf", negate=True)
    # densa --deterministic beside densa (the same engine arguments otherwise): its cost.
    deterministic_pair: bool = option(
        False, "also run densa with --deterministic, interleaved (its cost)", toggle=True
    )

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("--prompt-len and --output-len must be >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("--repeats must be >= 1 and --warmup >= 0")

    @classmethod
    def densa_only(cls, waves: WaveShape) -> ServingSettings:
        """The waves another benchmark runs (its own shape and defaults), densa alone."""
        return cls(
            concurrency=waves.concurrency,
            prompt_len=waves.prompt_len,
            output_len=waves.output_len,
            repeats=waves.repeats,
            warmup=waves.warmup,
            prompt_seed=waves.prompt_seed,
            include_hf=False,
        )


class WaveShape(Protocol):
    """The wave fields a benchmark's settings share with ServingSettings."""

    @property
    def concurrency(self) -> tuple[int, ...]: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def output_len(self) -> int: ...
    @property
    def repeats(self) -> int: ...
    @property
    def warmup(self) -> int: ...
    @property
    def prompt_seed(self) -> int: ...


BENCHMARK = BenchmarkCommand(
    name="serving",
    help="throughput and latency vs concurrency, densa vs transformers generate",
    description="Waves of concurrent requests (random prompts, fixed output length), densa "
    "vs Hugging Face transformers `generate` on the same weights, interleaved.",
    settings=ServingSettings,
    out=Path("docs/benchmarks/serving"),
    runner="densa_bench.serving.runner:run_serving",
    engine_defaults={"kv_cache_memory": BENCH_KV_CACHE_MEMORY},
)
