"""The machine a number was measured on, the command that measured it, and peak memory."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch

from densa.utils.cpu import cpu_model, vector_flags, vector_isa

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # Linux clear_refs code: reset the peak resident set size (VmHWM)


# ---- the machine -----------------------------------------------------------------------------
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
        "cpu_vector_isa": vector_isa(),
        "cpu_vector_flags": " ".join(vector_flags()),
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
    isa = hardware.get("cpu_vector_isa")
    cpu = f"{hardware['cpu_model']}" + (f" ({isa})" if isa else "")
    where = hardware["gpu"] or f"{cpu}, {hardware['torch_threads']} torch threads"
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
