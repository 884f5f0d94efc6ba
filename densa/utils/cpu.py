"""What the CPU can do: its vector instruction sets, read once from /proc/cpuinfo.

Kernels choose their code path from this at run time (development machines differ: some have
AVX-512 with VNNI, some only AVX2), and benchmark reports name it next to absolute times.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path

# Forces the kernels' code path (`avx2` on an AVX-512 machine; densa/kernels/cpu/native.py).
ISA_ENV = "DENSA_CPU_ISA"
# The vector extensions densa's kernels and reports care about, widest first.
VECTOR_FLAGS = (
    "amx_int8",
    "amx_bf16",
    "avx512_vnni",
    "avx512_bf16",
    "avx512bw",
    "avx512f",
    "avx_vnni",
    "avx2",
    "fma",
)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def vector_flags() -> list[str]:
    """The VECTOR_FLAGS this CPU has, widest first."""
    flags = cpu_flags()
    return [flag for flag in VECTOR_FLAGS if flag in flags]


def vector_isa() -> str:
    """A short name for the widest vector ISA: 'avx512_vnni', 'avx512', 'avx2' or 'baseline'."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512_vnni"
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "baseline"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what the platform module knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
