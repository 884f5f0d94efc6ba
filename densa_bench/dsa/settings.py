"""The settings and the command of `densa bench dsa`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from densa_bench.common.benchmark import BenchmarkCommand, option, write_report

MODEL = "the random model (GLM-5's attention, fewer layers and experts)"


@dataclass(frozen=True)
class DsaSettings:
    contexts: tuple[int, ...] = option((1024, 2048, 4096, 8192, 16384, 32768), "tokens cached")
    repeats: int = option(5, "timed decode steps per point (the median is reported)")
    kv_dtypes: tuple[str, ...] = option(("bfloat16", "fp8_e4m3"), "latent and index pages")
    num_layers: int = option(2, "the first a dense MLP, the rest MoE", group=MODEL)
    num_experts: int = option(4, group=MODEL)
    expert_intermediate_size: int = option(512, group=MODEL)
    dtype: str = option("float32", "weights and compute (float32: the CPU default)", group=MODEL)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 2 or self.repeats < 1:
            raise ValueError("need contexts of >= 2 tokens and --repeats >= 1")
        if self.num_layers < 1 or self.num_experts < 1:
            raise ValueError("need --num-layers >= 1 and --num-experts >= 1")


def _run(settings: DsaSettings, ns: argparse.Namespace) -> int:
    from densa_bench.dsa.runner import run_dsa

    return write_report(run_dsa(settings), ns.out)


BENCHMARK = BenchmarkCommand(
    name="dsa",
    help="decode step time and KV bytes read: DeepSeek Sparse Attention vs dense MLA",
    description="A random GLM-5-shaped model (its attention dims, fewer layers and experts), "
    "KV pages filled to each context length, one decode step timed with the indexer choosing "
    "2048 tokens and with every token attended; the attention alone timed beside it.",
    settings=DsaSettings,
    out=Path("docs/benchmarks/dsa"),
    run_with=_run,
    engine_defaults=None,
)
