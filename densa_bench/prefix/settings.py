"""The settings and the command of `densa bench prefix`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BENCH_KV_CACHE_MEMORY,
    BenchmarkCommand,
    option,
    write_report,
)


@dataclass(frozen=True)
class PrefixSettings:
    prefix_lens: tuple[int, ...] = option((256, 512, 1024))
    # new tokens after the shared prefix
    suffix_len: int = option(32, "new tokens after the prefix")
    repeats: int = option(3)
    turns: int = option(8, "turns per conversation")
    # the conversation's opening (system prompt + first question)
    system_len: int = option(256, "tokens of the first turn")
    # tokens each later user message adds
    user_len: int = option(64, "tokens each user message adds")
    # tokens each answer adds (generated greedily, EOS ignored)
    answer_len: int = option(32, "tokens each answer adds")
    warmup: int = option(1)
    seed: int = option(0, flag="--prompt-seed")

    def __post_init__(self) -> None:
        if not self.prefix_lens or min(self.prefix_lens) < 1 or self.suffix_len < 1:
            raise ValueError("--prefix-lens and --suffix-len must be >= 1")
        if self.repeats < 1 or self.turns < 1 or self.warmup < 0:
            raise ValueError("--repeats and --turns must be >= 1, --warmup >= 0")
        if min(self.system_len, self.user_len, self.answer_len) < 1:
            raise ValueError("--system-len, --user-len and --answer-len must be >= 1")


def _run(settings: PrefixSettings, ns: argparse.Namespace) -> int:
    from densa.setup.args import EngineArgs
    from densa_bench.prefix.runner import run_prefix

    engine_args = EngineArgs.from_cli(ns)
    if not engine_args.enable_prefix_caching:
        print("densa bench prefix: it measures the prefix cache; drop --no-enable-prefix-caching")
        return 2
    return write_report(run_prefix(settings, engine_args), ns.out)


BENCHMARK = BenchmarkCommand(
    name="prefix",
    help="TTFT with a cached prefix vs cold, and per turn of a multi-turn chat",
    description="Time to first token for requests sharing a cached prefix vs never-seen ones "
    "of the same length, and per turn of a chat with and without prefix reuse, interleaved.",
    settings=PrefixSettings,
    out=Path("docs/benchmarks/prefix"),
    run_with=_run,
    engine_defaults={"kv_cache_memory": BENCH_KV_CACHE_MEMORY},
)
