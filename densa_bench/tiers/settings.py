"""The settings and the command of `densa bench tiers`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densa_bench.common.benchmark import (
    BenchmarkCommand,
    option,
    write_report,
)

VARIANTS = ("off", "disk", "shared")


@dataclass(frozen=True)
class TiersSettings:
    num_sessions: int = option(8)
    num_turns: int = option(3)
    # per session: tool schemas, truncated to this many tokens
    system_tokens: int = option(2048, "tool schemas per session")
    user_tokens: int = option(48, "tokens each user message adds")  # each later user message
    max_tokens: int = option(16, "tokens each answer adds")  # each answer (greedy, EOS ignored)
    # of the live sessions' final contexts the device pool holds
    pool_share: float = option(0.25, "share of the live sessions' contexts the device pool holds")
    workers: tuple[int, ...] = option((1, 2), choices=(1, 2))
    variants: tuple[str, ...] = option(VARIANTS, choices=VARIANTS)

    def __post_init__(self) -> None:
        if self.num_sessions < 2 or self.num_turns < 2:
            raise ValueError("--num-sessions and --num-turns must be >= 2")
        if not 0 < self.pool_share <= 1:
            raise ValueError("--pool-share must be in (0, 1]")
        if set(self.variants) - set(VARIANTS) or set(self.workers) - {1, 2}:
            raise ValueError(f"--variants from {VARIANTS}; --workers from 1, 2")

    @property
    def final_context(self) -> int:
        return self.system_tokens + self.num_turns * (self.user_tokens + self.max_tokens)


def _run(settings: TiersSettings, ns: argparse.Namespace) -> int:
    from densa.setup.args import EngineArgs
    from densa_bench.tiers.runner import run_tiers

    def save(report: Any) -> None:  # after each configuration: a cut-short run keeps them
        report.write(ns.out)

    return write_report(run_tiers(settings, EngineArgs.from_cli(ns), on_config=save), ns.out)


BENCHMARK = BenchmarkCommand(
    name="tiers",
    help="KV tiers (off / disk / shared Redis) under agent sessions, one and two workers",
    description="Agent-like sessions (long tool-schema system prompts, growing history) "
    "that the device pool cannot all keep: hit rate vs the ceiling, returning-turn TTFT and "
    "throughput with the KV tiers off, on a local disk and in a shared redis-server.",
    settings=TiersSettings,
    out=Path("docs/benchmarks/tiers"),
    run_with=_run,
)
