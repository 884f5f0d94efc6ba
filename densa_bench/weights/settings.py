"""The settings and the command of `densa bench weights`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BenchmarkCommand,
    option,
)

FORMATS = ("bf16", "fp8", "int4", "bf16+int4")

WORK_DIR = Path.home() / ".cache" / "densa" / "bench-weights"


@dataclass(frozen=True)
class WeightsSettings:
    formats: tuple[str, ...] = option(
        FORMATS, "bf16, fp8, int4, and bf16+int4 (phase-aware: bf16 prefill, int4 decode)"
    )
    concurrency: tuple[int, ...] = option((1, 8, 16, 32, 64))
    prefill_len: int = option(1024, "prompt tokens, prefill test")
    # decode waves: short prompts, so the timed part is decode
    prompt_len: int = option(64, "prompt tokens, decode waves")
    output_len: int = option(64, "output tokens, decode waves")
    repeats: int = option(3)
    int4_group_size: int = option(128, choices=(32, 64, 128))
    int4_symmetric: bool = option(True, toggle=True)
    work_dir: Path = option(WORK_DIR, "where converted checkpoints go")
    profile: bool = option(True, toggle=True)
    prompt_seed: int = option(0)

    def __post_init__(self) -> None:
        unknown = set(self.formats) - set(FORMATS)
        if unknown or not self.formats:
            raise ValueError(f"formats must be among {FORMATS}, got {sorted(unknown)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be >= 1")
        if min(self.prefill_len, self.prompt_len, self.repeats) < 1 or self.output_len < 2:
            raise ValueError("lengths and repeats must be >= 1, --output-len >= 2")


BENCHMARK = BenchmarkCommand(
    name="weights",
    help="BF16 vs FP8 vs INT4 weights: sizes, prefill tok/s, decode tok/s by concurrency",
    description="Converts --model to each weight format once (cached in --work-dir), loads "
    "one engine per format, and measures prefill and decode throughput interleaved.",
    settings=WeightsSettings,
    out=Path("docs/benchmarks/weights"),
    runner="densa_bench.weights.runner:run_weights",
    # One engine per format in one process: a fixed 1 GiB KV each (c=64 x 128 tokens ~ 0.4 GiB).
    engine_defaults={"kv_cache_memory": "1GiB", "max_num_batched_tokens": 1024},
)
