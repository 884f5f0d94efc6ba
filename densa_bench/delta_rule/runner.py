"""The delta-rule decode step (Gated DeltaNet, KDA) at Qwen3-Next's decode shape: densa's C++
kernel against its torch fallback (batched: gather, update, scatter) and the per-(request, head)
torch reference, over every linear-attention layer of one decode step.

    python -m densa_bench.delta_rule.runner --out docs/benchmarks/delta_rule [--repeats 5]
    DENSA_CPU_ISA=avx2 python -m densa_bench.delta_rule.runner ...    (the AVX2 path)

Shape: H = 32 value heads (q/k repeated from 16 key heads), Dk = Dv = 128, 36 layers, each layer
its own pool of 2B slots of which B are updated (so the states come from DRAM, as in a real step:
36 x B x 2 MiB), with GDN's per-head decay and KDA's per-channel one. A step's state traffic is
2 x B x H x Dk x Dv x 4 bytes per layer (each state read once and written once); GB/s is that
over the step's time, set beside this machine's copy bandwidth (torch `copy_` of 1 GiB: bytes
read + written per second, the best of 5), the most a read-once-write-once pass can reach.
Implementations are interleaved per repetition; the median and min..max step are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from densa.kernels.cpu import delta_rule, native
from densa.kernels.reference.delta_rule import delta_rule_decode_reference
from densa_bench.common.hardware import describe_hardware

NUM_LAYERS, NUM_HEADS, DK, DV = 36, 32, 128, 128
Step = Callable[..., torch.Tensor]
IMPLEMENTATIONS: dict[str, Step] = {
    "densa C++": delta_rule.delta_rule_decode,
    "torch batched": lambda pool, slots, *xs: delta_rule.torch_delta_rule_steps(
        pool, slots, *(x.unsqueeze(1) for x in xs)
    ),
    "torch reference": delta_rule_decode_reference,
}


def make_layers(batch: int, per_channel: bool, gen: torch.Generator) -> list[tuple]:
    """Per layer: (pool [2B, H, Dk, Dv], slot_ids [B], q, k, v, log_decay, beta)."""
    layers = []
    for _ in range(NUM_LAYERS):
        q = torch.nn.functional.normalize(torch.randn(batch, NUM_HEADS, DK, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(batch, NUM_HEADS, DK, generator=gen), dim=-1)
        decay_shape = (batch, NUM_HEADS, DK) if per_channel else (batch, NUM_HEADS)
        log_decay = -0.05 * torch.rand(decay_shape, generator=gen)
        pool = torch.randn(2 * batch, NUM_HEADS, DK, DV, generator=gen) * 0.1
        slots = torch.randperm(2 * batch, generator=gen)[:batch]
        v = torch.randn(batch, NUM_HEADS, DV, generator=gen)
        beta = torch.rand(batch, NUM_HEADS, generator=gen)
        layers.append((pool, slots, q * DK**-0.5, k, v, log_decay, beta))
    return layers


def step_seconds(step: Step, layers: list[tuple]) -> float:
    start = time.perf_counter()
    for args in layers:
        step(*args)
    return time.perf_counter() - start


def copy_bandwidth() -> float:
    """Bytes read + written per second by torch's copy of 1 GiB (the best of 5)."""
    src = torch.ones(2**28)
    dst = torch.empty_like(src)
    best = min(step_seconds(lambda: dst.copy_(src), [()]) for _ in range(5))
    return 2 * src.numel() * 4 / best


def run(args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    results: dict = {"points": {}}
    for decay in ("gdn", "kda"):
        for batch in args.batch:
            layers = make_layers(batch, decay == "kda", gen)
            state_bytes = 2 * batch * NUM_HEADS * DK * DV * 4 * NUM_LAYERS
            times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
            for step in IMPLEMENTATIONS.values():  # warm-up
                step_seconds(step, layers)
            for _ in range(args.repeats):
                for name, step in IMPLEMENTATIONS.items():
                    times[name].append(step_seconds(step, layers))
            results["points"][f"{decay}_batch_{batch}"] = {
                name: {
                    "step_ms_median": 1e3 * statistics.median(values),
                    "step_ms_min": 1e3 * min(values),
                    "step_ms_max": 1e3 * max(values),
                    "state_gb_per_s": state_bytes / statistics.median(values) / 1e9,
                    "state_gb_per_s_at_min": state_bytes / min(values) / 1e9,
                }
                for name, values in times.items()
            }
    return results


def markdown(results: dict) -> str:
    copy = results["copy_gb_per_s"]
    lines = [
        f"Code path {results['isa']}, {results['threads']} threads; "
        f"CPU: {results['hardware'].get('cpu_model')} ({results['hardware']['cpu_vector_flags']}); "
        f"copy bandwidth {copy:.1f} GB/s; load average {results['load_average']:.1f} "
        f"while it ran (a shared machine). One decode step = {NUM_LAYERS} layers x H {NUM_HEADS} "
        f"x Dk {DK} x Dv {DV}.",
        "",
        "| decay | B | implementation | step ms median (min..max) | vs densa C++ (median) "
        "| state GB/s median (at the min) | of copy bandwidth (at the min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for point, by_name in results["points"].items():
        decay, _, batch = point.partition("_batch_")
        base = by_name["densa C++"]["step_ms_median"]
        for name, e in by_name.items():
            lines.append(
                f"| {decay} | {batch} | {name} | {e['step_ms_median']:.2f} "
                f"({e['step_ms_min']:.2f}..{e['step_ms_max']:.2f}) | "
                f"{e['step_ms_median'] / base:.1f}x | {e['state_gb_per_s']:.1f} "
                f"({e['state_gb_per_s_at_min']:.1f}) | {e['state_gb_per_s'] / copy:.0%} "
                f"({e['state_gb_per_s_at_min'] / copy:.0%}) |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/delta_rule"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    if not native.is_available():
        raise SystemExit("the C++ kernels are not built here")
    results = run(args)
    results.update(
        load_average=os.getloadavg()[0],
        copy_gb_per_s=copy_bandwidth() / 1e9, hardware=describe_hardware(), isa=native.isa(),
        threads=torch.get_num_threads(),
        command="python -m densa_bench.delta_rule.runner " + " ".join(
            ["--repeats", str(args.repeats), "--batch", *map(str, args.batch)]
        ),
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (args.out / f"results_{native.isa()}.md").write_text(table)
    (args.out / f"results_{native.isa()}.json").write_text(json.dumps(results, indent=2))
    print(table)


if __name__ == "__main__":
    main()
