"""The settings and the command of `densa bench kv-sweep`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BenchmarkCommand,
    option,
)
from densa_bench.serving.settings import ServingSettings


@dataclass(frozen=True)
class KVSweepSettings:
    concurrency: tuple[int, ...] = option((1, 8, 16, 32, 64), "requests/wave")
    prompt_len: int = option(1024, "prompt tokens per request")
    output_len: int = option(128, "output tokens (EOS ignored)")
    # The KV budget in BF16 requests of prompt_len + output_len tokens. 16.5 -> BF16 holds 16
    # whole requests and FP8 with dynamic scales (1.97x the tokens) 32.
    budget_requests: float = option(
        16.5, "KV budget in BF16 requests of prompt+output tokens (16.5: BF16 fits 16, FP8 32)"
    )
    kv_dtypes: tuple[str, ...] = option(("bfloat16", "fp8_e4m3"))
    repeats: int = option(2, "timed waves per variant and level")
    warmup: int = option(1, "untimed waves per variant first")
    prompt_seed: int = option(0, "seed of the random prompts")

    def __post_init__(self) -> None:
        if self.budget_requests < 1:
            raise ValueError("--budget-requests must be >= 1 (one request must fit)")
        if len(set(self.kv_dtypes)) != len(self.kv_dtypes) or not self.kv_dtypes:
            raise ValueError("--kv-dtypes must name distinct KV dtypes")
        self.serving()  # validates the shared fields

    @property
    def request_len(self) -> int:
        return self.prompt_len + self.output_len

    def serving(self) -> ServingSettings:
        return ServingSettings.densa_only(self)


BENCHMARK = BenchmarkCommand(
    name="kv-sweep",
    help="BF16 vs FP8 KV cache under one fixed KV budget, concurrency 1..64",
    description="Waves of long requests at each concurrency, one engine per KV dtype with "
    "the same KV memory in bytes, interleaved: throughput, admission, preemptions, latency.",
    settings=KVSweepSettings,
    out=Path("docs/benchmarks/kv_sweep"),
    runner="densa_bench.kv_sweep.runner:run_kv_sweep",
)
