"""Benchmarks a user can run (`densa bench ...`): results as JSON + Markdown + PNG plots.

(statistics, hardware, reports and plots come from densa.measure, shared with densa.eval)

timing.py   per-request timing and the ServingEngine protocol engines under test meet
serving.py  `densa bench serving`: densa vs transformers at fixed concurrency levels
serving_report.py   its summary, tables and plots;  hf_baseline.py   the transformers peer
attention_kernels.py   micro-benchmark of the CPU paged-attention kernels (python -m ...)
cli.py      `add_bench_parser`: the `densa bench ...` sub-commands
"""

from densa.bench.cli import add_bench_parser

__all__ = ["add_bench_parser"]
