"""Benchmarks a user can run (`densa bench ...`): results as JSON + Markdown + PNG plots.

common.py   statistics, interleaved repetitions, hardware, peak memory, progress
report.py   BenchReport: writes results.json, README.md and plots into one folder
timing.py   per-request timing and the ServingEngine protocol engines under test meet
serving.py  `densa bench serving`: densa vs transformers at fixed concurrency levels
serving_report.py   its summary, tables and plots;  hf_baseline.py   the transformers peer
cli.py      `add_bench_parser`: the `densa bench ...` sub-commands
"""

from densa.bench.cli import add_bench_parser

__all__ = ["add_bench_parser"]
