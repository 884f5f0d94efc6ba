"""The `densa bench` command: one sub-command per benchmark. Building the parser imports no
torch (each benchmark's settings.py declares its options; its runner loads when it runs)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from densa_bench.agent.cli import add_agent_parser
from densa_bench.common.benchmark import Benchmark
from densa_bench.disagg.settings import BENCHMARK as DISAGG
from densa_bench.dsa.settings import BENCHMARK as DSA
from densa_bench.hostile.settings import BENCHMARK as HOSTILE
from densa_bench.integrity.settings import BENCHMARK as INTEGRITY
from densa_bench.kv_sweep.settings import BENCHMARK as KV_SWEEP
from densa_bench.load.settings import BENCHMARK as LOAD
from densa_bench.memory.settings import BENCHMARK as MEMORY
from densa_bench.moe.settings import BENCHMARK as MOE
from densa_bench.peers.cli import add_peers_parser
from densa_bench.prefix.settings import BENCHMARK as PREFIX
from densa_bench.resident.cli import add_resident_parser
from densa_bench.router.settings import BENCHMARK as ROUTER
from densa_bench.serving.settings import BENCHMARK as SERVING
from densa_bench.speculative.cli import add_speculative_parser
from densa_bench.step_bytes.settings import BENCHMARK as STEP_BYTES
from densa_bench.structured.settings import BENCHMARK as STRUCTURED
from densa_bench.tiers.settings import BENCHMARK as TIERS
from densa_bench.weights.settings import BENCHMARK as WEIGHTS

# The benchmarks whose options come from their settings dataclass.
BENCHMARKS: tuple[Benchmark, ...] = (
    SERVING, INTEGRITY, LOAD, PREFIX, TIERS, KV_SWEEP, WEIGHTS, MOE, HOSTILE, STRUCTURED,
    ROUTER, STEP_BYTES, DISAGG, MEMORY, DSA,
)  # fmt: skip


# In the order `densa bench --help` lists them; peers and speculative still write their own
# options (their settings resolve models and thread counts first).
_SUB_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    SERVING.add_to, INTEGRITY.add_to, LOAD.add_to, PREFIX.add_to, TIERS.add_to, KV_SWEEP.add_to,
    WEIGHTS.add_to, MOE.add_to, HOSTILE.add_to, add_peers_parser, add_speculative_parser,
    STRUCTURED.add_to, ROUTER.add_to, STEP_BYTES.add_to, DISAGG.add_to, MEMORY.add_to,
    DSA.add_to, add_agent_parser, add_resident_parser,
)  # fmt: skip


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Add `densa bench` with one sub-command per benchmark to the `densa` sub-commands."""
    parser = commands.add_parser(
        "bench",
        help="measure densa (and its peers) on this machine",
        description="Benchmarks: results go to docs/benchmarks/<name>/ as JSON, Markdown and PNG.",
    )
    benchmarks = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    for add in _SUB_COMMANDS:
        add(benchmarks)
    parser.set_defaults(handler=lambda ns: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2
