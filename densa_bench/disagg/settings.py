"""The settings and the command of `densa bench disagg`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BenchmarkCommand,
    option,
)


@dataclass(frozen=True)
class DisaggSettings:
    num_decoders: int = option(16, "short requests decoding")
    decoder_prompt_len: int = option(64)
    decoder_output_len: int = option(96)
    num_long: int = option(3, "long prompts arriving meanwhile")
    long_prompt_len: int = option(2048)
    long_output_len: int = option(8)
    long_interval_s: float = option(1.5, "seconds between long ones", flag="--long-interval")
    repeats: int = option(3, "timed runs per variant")
    prompt_seed: int = option(0)

    def __post_init__(self) -> None:
        for name in ("num_decoders", "decoder_prompt_len", "decoder_output_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


BENCHMARK = BenchmarkCommand(
    name="disagg",
    help="co-located vs 1 prefill + 1 decode worker while long prompts keep arriving",
    description="Short requests decode while long prompts arrive: one co-located engine "
    "(2 threads) vs a prefill and a decode worker (1 core each), same formats and the "
    "reference split (prefill BF16 KV, decode INT4 + FP8 KV), interleaved.",
    settings=DisaggSettings,
    out=Path("docs/benchmarks/disagg"),
    runner="densa_bench.disagg.runner:run_disagg",
    engine_defaults={"kv_cache_memory": "1GiB"},
)
