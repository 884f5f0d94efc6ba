"""The settings and the command of `densa bench memory`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import BenchmarkCommand, option

# Issue 21's budget for everything that is not weights or KV pages: the interpreter, torch,
# the tokenizer, kernels' scratch, a step's activations, the HTTP front.
RUNTIME_ALLOWANCE_MIB = 400
FILE_FACTOR = 1.25  # weights may be resident at up to 1.25x the file's bytes


@dataclass(frozen=True)
class MemorySettings:
    model: str = option("qwen2.5-coder-1.5b", "a catalog name or a .gguf file")
    peer: str = option("densa", "which `densa bench peers` configuration of densa to start")
    concurrency: int = option(64, "requests in the wave (and sequences the server holds)")
    prompt_len: int = option(128, "prompt tokens per request")
    output_len: int = option(32, "output tokens (EOS ignored)")
    waves: int = option(1, "waves of --concurrency requests after the load")
    sample_interval_s: float = option(0.05, "how often the process tree's RSS is sampled")

    def __post_init__(self) -> None:
        if min(self.concurrency, self.waves) < 1 or self.prompt_len < 8 or self.output_len < 2:
            raise ValueError("--concurrency and --waves must be >= 1, --prompt-len >= 8, "
                             "--output-len >= 2")  # fmt: skip
        if self.sample_interval_s <= 0:
            raise ValueError("--sample-interval-s must be > 0")


def _run(settings: MemorySettings, ns: object) -> int:
    from densa_bench.common.benchmark import write_report
    from densa_bench.memory.runner import run_memory

    return write_report(run_memory(settings, getattr(ns, "out")), getattr(ns, "out"))  # noqa: B009


BENCHMARK = BenchmarkCommand(
    name="memory",
    help="whole-life peak RSS of `densa serve` (load + a wave) against issue 21's bound",
    description="Starts densa's server as `densa bench peers` does (the KV budget llama-server "
    "would take for the same slots), samples the RSS of every process of it from start to stop, "
    "runs --waves waves of --concurrency requests, and reports each process's high-water mark "
    "(never reset: the load counts), its make-up (/proc smaps_rollup) and the bound file size x "
    f"{FILE_FACTOR} + KV budget + {RUNTIME_ALLOWANCE_MIB} MiB.",
    settings=MemorySettings,
    out=Path("docs/benchmarks/memory"),
    run_with=_run,
    engine_defaults=None,
)
