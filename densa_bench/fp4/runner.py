"""The FP4 kernels (MXFP4A8, NVFP4A8) against densa's INT4 kernels at the same shapes: every linear
layer of Qwen2.5-Coder-1.5B (28 x q|k|v [2048, 1536], o [1536, 1536], gate|up [17920, 1536],
down [1536, 8960]) as one decode step's matmuls, interleaved by format, repeated.

    python -m densa_bench.fp4.runner --out docs/benchmarks/fp4 [--repeats 5] [--rows 1 8]

Formats: w4a8 (densa's C++ INT4: Q4_1's codes, fp16 scale and minimum per 32, int8
activations), int4 g128 (4-bit codes, bf16 scale per 128, torch's packed CPU op with bf16
activations: densa's `int4` format), mxfp4 and nvfp4 (C++, weight-only: float32 activations),
mxfp4a8 and nvfp4a8 (the same blocks, int8 activations). Weights are random
codes and scales in each format's layout (speed does not depend on the values). Reported per
format: resident bytes per weight (measured from the tensors), the step's median time and its
min..max over repetitions, tokens per second of the linear layers alone (rows / step), and the
bytes streamed per second. Each decoder layer's four matmuls are timed on their own and the
step is the sum over layers of each layer's median (and of each layer's best: on a shared
machine a stall spoils one layer's sample, not the step). Attention, norms and the output head
are not in the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from densa.formats.fp4 import Fp4Scheme
from densa.kernels.cpu import native, qgemm
from densa.kernels.cpu.int4_linear import cpu_int4_linear, pack_for_cpu
from densa_bench.common.hardware import describe_hardware

# Qwen2.5-Coder-1.5B: (out, in) of each linear layer, 28 layers.
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
NUM_LAYERS = 28
FORMATS = ("w4a8", "int4-g128", "mxfp4", "mxfp4a8", "nvfp4", "nvfp4a8")
Matmul = Callable[[torch.Tensor], torch.Tensor]


def _codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)


def _packed_nibbles(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)


def _fp4_weight(
    scheme: Fp4Scheme, int8: bool, n: int, k: int, gen: torch.Generator
) -> qgemm.PackedWeight:
    """Random FP4 codes and scale bytes in the scheme's layout, packed for the C++ kernels."""
    isa, shape = native.isa(), (n, k // scheme.group)
    if not scheme.has_tensor_scale:
        scales = torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8)
        return qgemm.pack_mxfp4(_packed_nibbles(n, k, gen), scales, isa, int8)
    scales = torch.randint(0x30, 0x50, shape, generator=gen, dtype=torch.uint8)
    t = torch.full((n,), 1e-3)
    return qgemm.pack_nvfp4(_packed_nibbles(n, k, gen), scales, t, isa, int8)


def make_layer(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[Matmul, int]:
    """A matmul over an [n, k] weight in `fmt`, and its resident bytes."""
    isa = native.isa()
    if fmt == "w4a8":
        d = (torch.rand(n, k // 32, generator=gen) * 1e-2).half().float()
        packed = qgemm.pack_w4(_codes(n, k, gen), d, -8 * d, isa)
        return (lambda x: qgemm.quantized_linear(x, packed)), packed.blocks.numel()
    scheme = Fp4Scheme.named(fmt.removesuffix("a8"))  # mxfp4, mxfp4a8, nvfp4, nvfp4a8
    if scheme is not None:
        packed = _fp4_weight(scheme, fmt.endswith("a8"), n, k, gen)
        return (lambda x: qgemm.quantized_linear(x, packed)), packed.blocks.numel()
    scales = (torch.rand(n, k // 128, generator=gen) * 1e-2).to(torch.bfloat16)
    pack = pack_for_cpu(_packed_nibbles(n, k, gen), scales, None, 128, k)
    assert pack is not None
    size = pack.packed.numel() * pack.packed.element_size()
    size += pack.scales_and_zeros.numel() * pack.scales_and_zeros.element_size()
    return (
        lambda x: cpu_int4_linear(x, pack.packed, pack.scales_and_zeros, pack.group_size, None)
    ), size


def build(fmt: str, num_layers: int, seed: int) -> tuple[list[tuple[Matmul, int]], int]:
    gen = torch.Generator().manual_seed(seed)
    layers = [(*make_layer(fmt, n, k, gen), k) for _ in range(num_layers) for n, k in SHAPES]
    return [(fn, k) for fn, _, k in layers], sum(size for _, size, _ in layers)


def layer_seconds(layers: list[tuple[Matmul, int]], x_by_k: dict[int, torch.Tensor]) -> list[float]:
    """One step: the time of each decoder layer's four matmuls, in order."""
    times, per_layer = [], len(SHAPES)
    for first in range(0, len(layers), per_layer):
        start = time.perf_counter()
        for fn, k in layers[first : first + per_layer]:
            fn(x_by_k[k])
        times.append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> dict:
    weights = NUM_LAYERS * sum(n * k for n, k in SHAPES)
    built = {fmt: build(fmt, NUM_LAYERS, seed=i) for i, fmt in enumerate(FORMATS)}
    results: dict = {"weights_per_step": weights, "formats": {}}
    for rows in args.rows:
        x_by_k = {k: torch.randn(rows, k) for _, k in SHAPES}
        times: dict[str, list[list[float]]] = {fmt: [] for fmt in FORMATS}
        for fmt in FORMATS:  # warm-up: first calls, allocator growth
            layer_seconds(built[fmt][0], x_by_k)
        for _ in range(args.repeats):  # interleaved: A B C D A B C D ...
            for fmt in FORMATS:
                times[fmt].append(layer_seconds(built[fmt][0], x_by_k))
        for fmt in FORMATS:
            # Per layer over the repetitions, then summed: a stall of the shared machine spoils
            # one layer's sample, not a whole step.
            by_layer = list(zip(*times[fmt], strict=True))
            median = sum(statistics.median(layer) for layer in by_layer)
            best = sum(min(layer) for layer in by_layer)
            entry = results["formats"].setdefault(
                fmt, {"bytes_per_weight": built[fmt][1] / weights}
            )
            entry[f"rows_{rows}"] = {
                "step_ms_median": 1e3 * median,
                "step_ms_min": 1e3 * best,
                "step_ms_max": 1e3 * max(sum(step) for step in times[fmt]),
                "tokens_per_s": rows / median,
                "weight_gb_per_s": built[fmt][1] / median / 1e9,
            }
    return results


def markdown(results: dict, rows: list[int]) -> str:
    head = "| format | bytes / weight | " + " | ".join(
        f"{r} row{'s' if r > 1 else ''}: step ms median (min..max) | tok/s at the min | GB/s"
        for r in rows
    )
    lines = [head + " |", "|" + "---|" * (2 + 3 * len(rows))]
    base = results["formats"]["w4a8"]
    for fmt, entry in results["formats"].items():
        cells = [fmt, f"{entry['bytes_per_weight']:.4f}"]
        for r in rows:
            e = entry[f"rows_{r}"]
            best = r / e["step_ms_min"] * 1e3
            ratio = base[f"rows_{r}"]["step_ms_min"] / e["step_ms_min"]
            cells += [
                f"{e['step_ms_median']:.1f} ({e['step_ms_min']:.1f}..{e['step_ms_max']:.1f})",
                f"{best:.1f} ({ratio:.2f}x w4a8)",
                f"{entry['bytes_per_weight'] * weights_of(results) / e['step_ms_min'] / 1e6:.1f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def weights_of(results: dict) -> int:
    return int(results["weights_per_step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/fp4"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--models", nargs="+", default=[],
        help="LABEL=PATH[:WEIGHT_FORMAT] ...: time whole decode steps of these checkpoints "
        "(interleaved) instead of the kernels alone",
    )  # fmt: skip
    args = parser.parse_args()
    if not native.is_available():
        raise SystemExit("the C++ kernels are not built here")
    if args.models:
        models = {"models": run_models(args), "hardware": describe_hardware(),
                  "isa": native.isa(), "threads": torch.get_num_threads(),
                  "command": "python -m densa_bench.fp4.runner " + " ".join(
                      ["--repeats", str(args.repeats), "--rows", *map(str, args.rows),
                       "--models", *args.models])}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"models_{native.isa()}.json").write_text(json.dumps(models, indent=2))
        print(json.dumps(models["models"], indent=2))
        return
    results = run(args)
    results["hardware"] = describe_hardware()
    results["isa"] = native.isa()
    results["threads"] = torch.get_num_threads()
    results["command"] = "python -m densa_bench.fp4.runner " + " ".join(
        ["--repeats", str(args.repeats), "--rows", *map(str, args.rows)]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(results, args.rows)
    (args.out / f"results_{native.isa()}.md").write_text(table)
    (args.out / f"results_{native.isa()}.json").write_text(json.dumps(results, indent=2))
    print(table)


# ---- the whole model: decode steps of the real 1.5B per weight format ---------------------------
def decode_step_ms(engine: Any, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Median wall time of a decode step (all `batch` requests decoding), in ms."""
    from densa.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for b in range(batch):
        engine.add_request([(31 * i + 7 * b) % 30000 + 100 for i in range(prompt_len)], params)
    times, step = [], 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        if step >= 2:  # past the prefill steps
            times.append(time.perf_counter() - start)
        step += 1
    return 1e3 * statistics.median(times)


def run_models(args: argparse.Namespace) -> dict:
    from densa.engine.llm_engine import LLMEngine
    from densa.setup.args import EngineArgs

    engines = {}
    for spec in args.models:
        label, _, rest = spec.partition("=")
        path, _, weight_format = rest.partition(":")
        engine_args = EngineArgs(
            model=path, weight_format=weight_format or "auto", max_model_len=256,
            kv_cache_memory="256MiB",
        )  # fmt: skip
        engines[label] = LLMEngine.from_args(engine_args)
    out: dict = {}
    for batch in args.rows:
        samples: dict[str, list[float]] = {label: [] for label in engines}
        for engine in engines.values():  # warm-up
            decode_step_ms(engine, batch, 64, 4)
        for _ in range(args.repeats):
            for label, engine in engines.items():
                samples[label].append(decode_step_ms(engine, batch, 64, 16))
        for label, values in samples.items():
            median = statistics.median(values)
            out.setdefault(label, {})[f"batch_{batch}"] = {
                "step_ms_median": median, "step_ms_min": min(values), "step_ms_max": max(values),
                "tokens_per_s": 1e3 * batch / median,
            }  # fmt: skip
    return out


if __name__ == "__main__":
    main()
