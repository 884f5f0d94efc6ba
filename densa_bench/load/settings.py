"""The settings and the command of `densa bench load`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import (
    BENCH_KV_CACHE_MEMORY,
    BenchmarkCommand,
    option,
    write_report,
)


@dataclass(frozen=True)
class LoadSettings:
    num_clients: int = option(64, flag="--clients")
    prompt_lens: tuple[int, ...] = option((64, 128, 512, 1024))  # each client draws one
    # half the clients start with the same prefix (cache hits)
    shared_prefix_len: int = option(48, "half the clients share it")
    # for clients that read the whole answer
    max_tokens: int = option(32, "for clients that read it all")
    # for clients that leave early: they are surely still running
    long_max_tokens: int = option(256, "for clients that leave")
    disconnect_fraction: float = option(0.15)  # close the connection after a few events
    cancel_fraction: float = option(0.15)  # the client task is cancelled mid-stream
    # the whole run; a request still open then counts as hung
    time_limit_s: float = option(600.0, "seconds for the whole run", flag="--time-limit")
    # Tokens the engine may still sample for a client after it left (the abort crosses from the
    # event loop to the engine between steps): more than this per leaver means it kept running.
    max_tokens_after_leaving: int = 32
    seed: int = option(0, "seed of prompts and behaviours", flag="--plan-seed")

    def __post_init__(self) -> None:
        if self.num_clients < 1 or not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError("--clients and --prompt-lens must be >= 1")
        if self.shared_prefix_len >= min(self.prompt_lens) and self.shared_prefix_len:
            raise ValueError("--shared-prefix-len must be shorter than every prompt length")
        if not 0 <= self.disconnect_fraction + self.cancel_fraction <= 1:
            raise ValueError("the disconnect and cancel fractions must add up to at most 1")


def _server_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--url", default=None, help="a running server (default: start one here)")
    group.add_argument("--served-model", default=None, help="with --url (default: ask the server)")


def _run(settings: LoadSettings, ns: argparse.Namespace) -> int:
    """Exit status 1 when the run found a problem (a request lost, a page leaked, ...)."""
    from densa.setup.args import EngineArgs
    from densa_bench.load.report import run_load_bench

    report, problems = run_load_bench(settings, EngineArgs.from_cli(ns), ns.url, ns.served_model)
    write_report(report, ns.out)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


BENCHMARK = BenchmarkCommand(
    name="load",
    help="many concurrent streaming clients, some leaving early: nothing lost, nothing leaked",
    description="N streaming clients at once on loopback (mixed prompt lengths, some "
    "disconnecting, some cancelled); checks every request ended cleanly, every KV page is "
    "free afterwards and /metrics agrees with the clients. Exit status 1 if not.",
    settings=LoadSettings,
    out=Path("docs/benchmarks/load"),
    run_with=_run,
    engine_defaults={"kv_cache_memory": BENCH_KV_CACHE_MEMORY},
    extra_options=_server_options,
)
