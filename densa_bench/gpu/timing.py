"""What the GPU check's kernel parts share: the problem sizes (the H200's and a tiny CPU set),
the results they collect, and how they time a kernel against the HBM roofline and compare it
with its reference."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

ROOFLINE_GBS = 4300.0  # H200 device-to-device copy, measured on this workplace's machines
GOALS = {"decode_attention_fp8": 0.70, "int4_gemv": 0.60}


@dataclass(frozen=True)
class Sizes:
    heads: tuple[int, int, int]  # query heads, kv heads, head dim
    page_size: int
    decode_shapes: tuple[tuple[int, int], ...]  # (sequences, context tokens)
    check_lens: tuple[int, ...]  # context lengths of the correctness cases
    linear_shapes: tuple[tuple[int, int], ...]  # (out_features, in_features)
    linear_rows: tuple[int, ...]
    tag_pairs: int
    min_stream_bytes: int  # weight copies per timing add up to at least this

    @classmethod
    def h200(cls) -> Sizes:
        return cls(
            heads=(32, 8, 128),
            page_size=16,
            decode_shapes=((64, 4096), (8, 16384), (1, 32768)),
            check_lens=(1, 77, 600, 1500),
            # Llama-3-8B's projections (q|k|v, o, gate|up, down) and TinyLlama's gate|up.
            linear_shapes=((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (11264, 2048)),
            linear_rows=(1, 16, 64),
            tag_pairs=64 * 256,
            min_stream_bytes=512 << 20,
        )

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(
            heads=(8, 2, 32),
            page_size=4,
            decode_shapes=((2, 40),),
            check_lens=(1, 21),
            linear_shapes=((64, 256),),
            linear_rows=(1,),
            tag_pairs=600,
            min_stream_bytes=0,
        )


@dataclass
class KernelResults:
    correctness: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


TimeLeft = Callable[[], float]  # seconds left of the check's budget
# Seconds kept back for the end-to-end sweep when the kernel timings decide whether to go on.
TIMING_RESERVE_S = 240.0


# ---- timing ------------------------------------------------------------------------------------
def time_ms(run: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median milliseconds of run() (CUDA events on a GPU; wall clock elsewhere)."""
    run()  # warm-up: compiles
    times = []
    if device.type != "cuda":
        for _ in range(2):
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth, bytes read plus written per second (the roofline)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def timing_row(kernel: str, shape: str, ms: float, nbytes: int, **extra: Any) -> dict[str, Any]:
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {"kernel": kernel, "shape": shape, "ms": ms, "bytes": nbytes, "gbs": gbs,
            "roofline_frac": gbs / ROOFLINE_GBS, **extra}  # fmt: skip


def compare(name: str, case: str, got: torch.Tensor, expected: torch.Tensor, tol: float) -> dict:
    error = (got.float().cpu() - expected.float().cpu()).abs().max().item()
    scale = expected.float().abs().max().item()
    return {"kernel": name, "case": case, "max_abs_err": error, "max_abs_ref": scale,
            "tolerance": tol, "ok": bool(error <= tol * max(1.0, scale))}  # fmt: skip
