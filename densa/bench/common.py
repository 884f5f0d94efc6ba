"""Pieces every benchmark shares: statistics, interleaved repetitions, hardware, memory, progress.

How densa measures (docs: /work/shared/BENCHMARKS.md): compare configurations inside one run,
interleaved A B A B ..., report the median with the min..max spread, and name the hardware.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import resource
import shlex
import sys
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

T = TypeVar("T")

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # Linux clear_refs code: reset the peak resident set size (VmHWM)


# ---- statistics ------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def latency_stats(values: Sequence[float]) -> dict[str, float]:
    """Median, p95, p99, mean, min and max of latency samples (seconds in, seconds out)."""
    return {
        "median": median(values),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
        "count": len(values),
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and min..max of repeated measurements: what every comparison is reported with."""
    return {"median": median(values), "min": min(values), "max": max(values)}


def format_spread(stats: dict[str, float], digits: int = 1) -> str:
    """'12.3 (11.9..12.8)': median with the min..max spread of the repetitions."""
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}..{stats['max']:.{digits}f})"


# ---- interleaved repetitions -----------------------------------------------------------------
def interleave(variants: Sequence[T], repeats: int) -> list[tuple[int, T]]:
    """(repeat_idx, variant) pairs in the order A B A B ...: each repetition runs every variant.

    Interleaving spreads slow drift (thermal state, a neighbour's load) over every variant instead
    of letting it fall on whichever ran last.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [(repeat_idx, variant) for repeat_idx in range(repeats) for variant in variants]


# ---- the machine -----------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what the platform module knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def gpu_name() -> str | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def describe_hardware() -> dict[str, Any]:
    """What an absolute number depends on: CPU, threads, memory, GPU and library versions.

    The load average is recorded too: on a shared machine it tells a reader how noisy the run was.
    """
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": psutil.virtual_memory().total,
        "gpu": gpu_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _package_version("transformers"),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def hardware_summary(hardware: dict[str, Any]) -> str:
    """One line naming the hardware, for table captions and plot titles."""
    where = hardware["gpu"] or f"{hardware['cpu_model']}, {hardware['torch_threads']} torch threads"
    return f"{where}; torch {hardware['torch']}"


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def command_line() -> str:
    """The command that is running, as a shell line someone can paste to reproduce it."""
    program = Path(sys.argv[0]).name
    if program != "densa":  # e.g. `python -m densa.cli` or a test runner: keep the full path
        program = sys.argv[0]
    return shlex.join([program, *sys.argv[1:]])


# ---- memory ----------------------------------------------------------------------------------
class PeakRSS:
    """Peak resident memory of this process over a span of work.

    On Linux the kernel's high-water mark (VmHWM) is reset at `start()`, so the peak belongs to
    that span alone; elsewhere it falls back to the process-lifetime peak (`ru_maxrss`).
    """

    def __init__(self) -> None:
        self.start_bytes = 0

    def start(self) -> None:
        with contextlib.suppress(OSError):
            _PROC_CLEAR_REFS.write_text(_RESET_PEAK_RSS)
        self.start_bytes = psutil.Process().memory_info().rss

    def peak_bytes(self) -> int:
        hwm = _read_status_kib("VmHWM")
        if hwm is not None:
            return hwm * 1024
        scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _read_status_kib(field: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return None


# ---- progress --------------------------------------------------------------------------------
@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[tqdm]:
    """A progress bar on stderr that densa's log lines print above instead of through.

    The bar is hidden when stderr is not a terminal (CI logs, `2> file`): there the per-run log
    lines are the progress report.
    """
    with (
        logging_redirect_tqdm(loggers=[logging.getLogger("densa")]),
        tqdm(
            total=total,
            desc=description,
            unit="run",
            file=sys.stderr,
            disable=not sys.stderr.isatty(),
        ) as bar,
    ):
        yield bar
