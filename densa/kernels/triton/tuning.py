"""Launch configurations for densa's Triton matmul kernels, and a small tuner that picks one by
timing candidates on the GPU.

Why not `triton.autotune`: split-K changes the output buffer a launch needs, and a pick must be
made before CUDA-graph capture (timing inside a capture is impossible). So a kernel's wrapper asks
`best()` for a config per shape bucket; on a GPU with tuning on (DENSA_TRITON_TUNE=1, or
`set_tuning(True)`), the first call per bucket times every candidate with CUDA events and keeps
the fastest; otherwise, and always in the CPU interpreter, the heuristic's choice is used. The
decision is the same call either way, so the eager warm-up before graph capture fixes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int  # unpacked input columns per step
    split_k: int = 1  # programs sharing one output tile's K range (partials summed after)
    num_warps: int = 4
    num_stages: int = 2

    def describe(self) -> str:
        return (
            f"m{self.block_m} n{self.block_n} k{self.block_k} split{self.split_k} "
            f"w{self.num_warps} s{self.num_stages}"
        )


_tuning = os.environ.get("DENSA_TRITON_TUNE", "0") not in ("", "0")
_chosen: dict[tuple[object, ...], LaunchConfig] = {}


def set_tuning(enabled: bool) -> None:
    global _tuning
    _tuning = enabled


def chosen_configs() -> dict[tuple[object, ...], LaunchConfig]:
    """Every pick made so far (benchmarks report them)."""
    return dict(_chosen)


def split_ranges(in_features: int, config: LaunchConfig) -> tuple[int, int]:
    """(input columns per split, a whole number of block_k steps; how many splits that makes)."""
    per_split = -(-in_features // config.split_k)
    per_split = -(-per_split // config.block_k) * config.block_k
    return per_split, -(-in_features // per_split)


def m_bucket(num_rows: int) -> int:
    """Rows rounded up to a power of two (1, 2, 4 .. 64, then 128 and beyond): one pick serves
    every M in its bucket."""
    return 1 << max(0, (num_rows - 1).bit_length())


def best(
    key: tuple[object, ...],
    candidates: Sequence[LaunchConfig],
    run: Callable[[LaunchConfig], object],
    device: torch.device,
) -> LaunchConfig:
    """The config for `key`: candidates[0] (the heuristic) unless tuning times them all."""
    found = _chosen.get(key)
    if found is not None:
        return found
    pick = candidates[0]
    if _tuning and device.type == "cuda" and len(candidates) > 1:
        pick = min(candidates, key=lambda config: _timed(run, config))
    _chosen[key] = pick
    return pick


def _timed(run: Callable[[LaunchConfig], object], config: LaunchConfig) -> float:
    try:
        return time_launch(lambda: run(config))
    except Exception:  # a config the GPU cannot run (e.g. out of shared memory): never picked
        return float("inf")


def time_launch(launch: Callable[[], object], repeats: int = 20) -> float:
    """Median milliseconds of one launch on the current CUDA stream (after a warm-up launch,
    which also compiles it)."""
    launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
