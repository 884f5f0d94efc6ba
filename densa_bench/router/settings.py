"""The settings and the command of `densa bench router`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BenchmarkCommand,
    option,
    write_report,
)


@dataclass(frozen=True)
class RouterBenchSettings:
    # sessions per tenant (unequal on purpose)
    tenant_sessions: tuple[int, ...] = option(
        (6, 2, 1), "sessions per tenant (one number per tenant)"
    )
    turns: int = option(6, "turns per session")
    # words of each tenant's system prompt (~1.5 tokens per word)
    system_words: int = option(100, "words per system prompt")
    # words of the document each user message carries
    user_words: int = option(60, "words per user message")
    max_tokens: int = option(24, "output tokens per turn")  # output tokens per turn (EOS ignored)
    # between session starts
    stagger_s: float = option(1.0, "seconds between session starts", flag="--stagger")
    repeats: int = option(2, "runs per policy (interleaved)")
    # tiny requests direct vs routed, for the router's added latency
    latency_probes: int = option(40, "direct/routed request pairs")
    kv_cache_memory: str = option("512MiB", "KV budget per worker")  # per worker
    max_model_len: int = 2048
    # None: the bundled SmolLM2-135M-Instruct
    model: str | None = option(None, "the workers' model (default: the bundled one)")

    def __post_init__(self) -> None:
        if not self.tenant_sessions or min(self.tenant_sessions) < 1:
            raise ValueError("--tenant-sessions must be >= 1 each")
        if self.turns < 1 or self.repeats < 1 or self.max_tokens < 1:
            raise ValueError("--turns, --repeats and --max-tokens must be >= 1")


def _work_dir_option(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--work-dir", type=Path, default=Path("/tmp/densa-bench-router"),
                       help="worker and router logs")  # fmt: skip


def _run(settings: RouterBenchSettings, ns: argparse.Namespace) -> int:
    from densa_bench.router.runner import run_router_bench

    return write_report(run_router_bench(settings, ns.work_dir), ns.out)


BENCHMARK = BenchmarkCommand(
    name="router",
    help="routing policies over 3 local workers: prefix hit rate, TTFT, router latency",
    description="Three `densa serve` workers (1 thread each) behind `densa router` with each "
    "policy in turn (round-robin, least-load, prefix, densa), interleaved: multi-tenant "
    "multi-turn chat with shared system prompts and sessions.",
    settings=RouterBenchSettings,
    out=Path("docs/benchmarks/router"),
    run_with=_run,
    engine_defaults=None,  # the workers are `densa serve` processes with their own options
    extra_options=_work_dir_option,
)
