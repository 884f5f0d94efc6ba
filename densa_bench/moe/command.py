"""`densa bench moe`: its command line. Not yet generated from settings dataclasses: it
combines two (MoeShape, WeightsSettings) and overrides the weights benchmark's defaults."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from densa.engine.args import EngineArgs
from densa_bench.common.benchmark import write_report


def add_moe_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "moe",
        help="BF16 vs INT4 experts on a random ~1B-parameter MoE made locally",
        description="Writes a random Qwen3-MoE-shaped checkpoint (once, in --work-dir), then "
        "runs the weights benchmark on it: sizes, prefill tok/s, decode tok/s by concurrency.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--formats", nargs="+", default=["bf16", "int4"], help="as in bench weights")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    g.add_argument("--prefill-len", type=int, default=512, help="prompt tokens, prefill test")
    g.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, decode waves")
    g.add_argument("--output-len", type=int, default=32, help="output tokens, decode waves")
    g.add_argument("--repeats", type=int, default=3)
    m = parser.add_argument_group("the random model (Qwen3-MoE shape)")
    m.add_argument("--num-layers", type=int, default=12)
    m.add_argument("--hidden-size", type=int, default=1024, help="a multiple of 256")
    m.add_argument("--num-experts", type=int, default=64)
    m.add_argument("--top-k", type=int, default=8, help="experts per token")
    m.add_argument("--expert-intermediate-size", type=int, default=384)
    g.add_argument("--work-dir", type=Path, default=None, help="model and checkpoints (cached)")
    g.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/moe"))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_moe, kv_cache_memory="1GiB", max_num_batched_tokens=1024)


def _moe(ns: argparse.Namespace) -> int:
    from densa_bench.moe.runner import MoeShape, run_moe
    from densa_bench.weights.runner import WeightsSettings

    def build() -> tuple[MoeShape, WeightsSettings]:
        shape = MoeShape(
            hidden_size=ns.hidden_size, num_layers=ns.num_layers, num_experts=ns.num_experts,
            top_k=ns.top_k, expert_intermediate_size=ns.expert_intermediate_size,
        )  # fmt: skip
        settings = WeightsSettings(
            formats=tuple(ns.formats), concurrency=tuple(ns.concurrency),
            prefill_len=ns.prefill_len, prompt_len=ns.prompt_len, output_len=ns.output_len,
            repeats=ns.repeats, profile=ns.profile,
            **({"work_dir": ns.work_dir} if ns.work_dir is not None else {}),
        )  # fmt: skip
        return shape, settings

    try:
        built = build()
    except ValueError as exc:
        print(f"densa bench moe: {exc}", file=sys.stderr)
        return 2
    return write_report(run_moe(*built, EngineArgs.from_cli(ns)), ns.out)
