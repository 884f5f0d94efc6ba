"""The settings and the command of `densa bench moe`: the weights benchmark's waves (a smaller
sweep by default) on a random model of a given shape."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densa_bench.common.benchmark import BenchmarkCommand, option, write_report

MODEL = "the random model (Qwen3-MoE shape)"


@dataclass(frozen=True)
class MoeSettings:
    formats: tuple[str, ...] = option(("bf16", "int4"), "as in bench weights")
    concurrency: tuple[int, ...] = option((1, 2, 4, 8, 16, 32))
    prefill_len: int = option(512, "prompt tokens, prefill test")
    prompt_len: int = option(64, "prompt tokens, decode waves")
    output_len: int = option(32, "output tokens, decode waves")
    repeats: int = option(3)
    num_layers: int = option(12, group=MODEL)
    hidden_size: int = option(1024, "a multiple of 256", group=MODEL)
    num_experts: int = option(64, group=MODEL)
    top_k: int = option(8, "experts per token", group=MODEL)
    expert_intermediate_size: int = option(384, group=MODEL)
    work_dir: Path | None = option(None, "model and checkpoints (cached)")  # None: as weights'
    profile: bool = option(True, toggle=True)


def _run(settings: MoeSettings, ns: argparse.Namespace) -> int:
    """The shape (MoeShape) and the waves (WeightsSettings) check themselves here, where the
    runner's module (torch) is loaded anyway."""
    from densa.setup.args import EngineArgs
    from densa_bench.moe.runner import MoeShape, run_moe
    from densa_bench.weights.settings import WeightsSettings

    s = settings
    work_dir: dict[str, Any] = {"work_dir": s.work_dir} if s.work_dir is not None else {}
    try:
        shape = MoeShape(
            hidden_size=s.hidden_size, num_layers=s.num_layers, num_experts=s.num_experts,
            top_k=s.top_k, expert_intermediate_size=s.expert_intermediate_size,
        )  # fmt: skip
        waves = WeightsSettings(
            formats=s.formats, concurrency=s.concurrency, prefill_len=s.prefill_len,
            prompt_len=s.prompt_len, output_len=s.output_len, repeats=s.repeats,
            profile=s.profile, **work_dir,
        )  # fmt: skip
    except ValueError as exc:
        print(f"densa bench moe: {exc}", file=sys.stderr)
        return 2
    return write_report(run_moe(shape, waves, EngineArgs.from_cli(ns)), ns.out)


BENCHMARK = BenchmarkCommand(
    name="moe",
    help="BF16 vs INT4 experts on a random ~1B-parameter MoE made locally",
    description="Writes a random Qwen3-MoE-shaped checkpoint (once, in --work-dir), then "
    "runs the weights benchmark on it: sizes, prefill tok/s, decode tok/s by concurrency.",
    settings=MoeSettings,
    out=Path("docs/benchmarks/moe"),
    run_with=_run,
    engine_defaults={"kv_cache_memory": "1GiB", "max_num_batched_tokens": 1024},
)
