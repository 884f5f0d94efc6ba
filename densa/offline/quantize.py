"""`densa quantize`: convert a checkpoint's linear weights to INT4, FP8, MXFP4 or NVFP4.
Building the parser imports no torch."""

from __future__ import annotations

import argparse
import sys


def add_quantize_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "quantize",
        help="convert a checkpoint's linear weights to INT4, FP8, MXFP4 or NVFP4 (docs/weights.md)",
        description="Quantize every linear layer of SRC (HF directory, .gguf, or a densa "
        "INT4/FP8 checkpoint) and save the result to DST; embeddings and the output head stay "
        "in --keep-dtype. The format is written into the safetensors metadata.",
    )
    parser.add_argument("src", help="source checkpoint: HF directory or .gguf file")
    parser.add_argument("dst", help="output directory (new)")
    parser.add_argument(
        "--weights",
        required=True,
        choices=["int4", "fp8", "mxfp4", "nvfp4", "bf16"],
        help="bf16: cast only; mxfp4 / nvfp4: e2m1 with block scales (round-to-nearest)",
    )
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    parser.add_argument(
        "--symmetric", action=argparse.BooleanOptionalAction, default=True,
        help="int4: symmetric (w = s*q) or asymmetric with a per-group offset (--no-symmetric)",
    )  # fmt: skip
    parser.add_argument("--method", default="rtn", choices=["rtn", "gptq"])
    parser.add_argument("--scale-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=128, help="fp8: square block side")
    parser.add_argument(
        "--keep-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
        help="dtype of the tensors left unquantized (embeddings, norms, output head)",
    )  # fmt: skip
    parser.add_argument(
        "--include-lm-head", action="store_true", help="quantize an untied output head too"
    )
    parser.add_argument(
        "--calibration-passages", type=int, default=128,
        help="gptq: LAMBADA passages (~80 tokens each) of calibration text",
    )  # fmt: skip
    moe = parser.add_argument_group("mixture-of-experts models (routers always stay dense)")
    moe.add_argument(
        "--keep-shared-experts", action="store_true", help="keep shared experts in --keep-dtype"
    )
    moe.add_argument(
        "--experts-only", action="store_true",
        help="quantize only the routed experts (attention and dense layers stay in --keep-dtype)",
    )  # fmt: skip
    parser.set_defaults(handler=_quantize)


def _quantize(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from densa.model.arch import ModelLoadError
    from densa.model.quantize import QuantizeSettings, quantize_checkpoint
    from densa.quant.weight_format import WeightFormat
    from densa.utils.sizes import format_bytes

    try:
        fmt = None
        if ns.weights != "bf16":
            fmt = WeightFormat(
                ns.weights, group_size=ns.group_size, symmetric=ns.symmetric,
                scale_dtype=ns.scale_dtype, block_size=ns.block_size, method=ns.method,
            )  # fmt: skip
        keep = "bfloat16" if ns.weights == "bf16" else ns.keep_dtype
        settings = QuantizeSettings(
            fmt, keep, ns.include_lm_head, ns.calibration_passages,
            keep_shared_experts=ns.keep_shared_experts, experts_only=ns.experts_only,
        )  # fmt: skip
        result = quantize_checkpoint(ns.src, Path(ns.dst), settings)
    except (ValueError, OSError, ModelLoadError) as exc:
        print(f"densa quantize: {exc}", file=sys.stderr)
        return 2
    what = fmt.describe() if fmt is not None else "bf16 (cast)"
    if result.source_file_bytes:
        print(f"source     {format_bytes(result.source_file_bytes):>12}  {ns.src}")
    print(f"dense src  {format_bytes(result.source_bytes):>12}  (the weights as densa reads them)")
    print(f"{ns.weights:<10} {format_bytes(result.output_bytes):>12}  {result.output_dir}")
    print(
        f"{what}: {result.num_quantized} tensors quantized, "
        f"{result.output_bytes / result.source_bytes:.2f}x the source size"
        + (f", {result.calibration_tokens} calibration tokens" if result.calibration_tokens else "")
    )
    return 0
