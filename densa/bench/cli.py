"""The `densa bench` command and its benchmarks. Building the parser imports no torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from densa.engine.args import EngineArgs

BENCH_KV_CACHE_MEMORY = "2GiB"  # fixed, not a fraction of free memory: runs stay comparable


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Add `densa bench` with one sub-command per benchmark to the `densa` sub-commands."""
    parser = commands.add_parser(
        "bench",
        help="measure densa (and its peers) on this machine",
        description="Benchmarks: results go to docs/benchmarks/<name>/ as JSON, Markdown and PNG.",
    )
    benchmarks = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    _add_serving(benchmarks)
    _add_integrity(benchmarks)
    parser.set_defaults(handler=lambda ns: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _add_serving(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "serving",
        help="throughput and latency vs concurrency, densa vs transformers generate",
        description="Waves of concurrent requests (random prompts, fixed output length), densa "
        "vs Hugging Face transformers `generate` on the same weights, interleaved.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests/wave")
    g.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    g.add_argument("--repeats", type=int, default=3, help="timed waves per engine and level")
    g.add_argument("--warmup", type=int, default=1, help="untimed waves per engine first")
    g.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--skip-hf", action="store_true", help="measure densa only")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/serving"), help="folder")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_serving, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _add_integrity(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "integrity",
        help="cost of KV integrity checks: on vs off, interleaved",
        description="Long-prompt, long-output waves with --kv-integrity on and off, interleaved, "
        "plus a direct timing of the batched check on the same step shapes.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    g.add_argument("--prompt-len", type=int, default=2048)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--prompt-seed", type=int, default=0)
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/integrity"))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_integrity, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _integrity(ns: argparse.Namespace) -> int:
    from densa.bench.integrity import IntegritySettings, run_integrity

    settings = IntegritySettings(
        concurrency=tuple(ns.concurrency),
        prompt_len=ns.prompt_len,
        output_len=ns.output_len,
        repeats=ns.repeats,
        warmup=ns.warmup,
        prompt_seed=ns.prompt_seed,
    )
    try:
        settings.serving()  # validates the shared fields
    except ValueError as exc:
        print(f"densa bench integrity: {exc}", file=sys.stderr)
        return 2
    report = run_integrity(settings, EngineArgs.from_cli(ns))
    return _write(report, ns.out)


def _write(report: Any, out: Path) -> int:
    paths = report.write(out)
    for table in report.tables:
        print(table.to_markdown() + "\n")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _serving(ns: argparse.Namespace) -> int:
    from densa.bench.serving import ServingSettings, run_serving

    try:
        settings = ServingSettings(
            concurrency=tuple(ns.concurrency),
            prompt_len=ns.prompt_len,
            output_len=ns.output_len,
            repeats=ns.repeats,
            warmup=ns.warmup,
            prompt_seed=ns.prompt_seed,
            include_hf=not ns.skip_hf,
        )
    except ValueError as exc:
        print(f"densa bench serving: {exc}", file=sys.stderr)
        return 2
    report = run_serving(settings, EngineArgs.from_cli(ns))
    paths = report.write(ns.out)
    for table in report.tables:
        print(table.to_markdown() + "\n")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
