"""densa's C++ CPU kernels (densa/kernels/cpu/csrc/), compiled once per machine, loaded on demand.

The extension is built with torch's C++ extension tooling the first time it is needed (or ahead
of time by `scripts/setup.sh`, which runs `python -m densa.kernels.cpu.native`) and cached under
~/.cache/densa/extensions/, keyed by the source and torch version. It uses torch's own thread
pool (at::parallel_for), so it shares torch's OpenMP runtime instead of adding another.

Code paths are chosen at run time from the CPU's flags (AVX-512 VNNI, else AVX2); the
environment variable DENSA_CPU_ISA=avx2 forces the AVX2 path on an AVX-512 machine, which is
how the tests cover both. Without a C++ compiler the extension is unavailable and callers fall
back to torch ops (slower, same results up to rounding).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from densa.utils.cpu import ISA_ENV
from densa.utils.logging import get_logger

logger = get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
_SOURCE_NAMES = (
    "module.cpp",
    "qgemm.cpp",
    "fp4gemm.cpp",
    "w8float.cpp",
    "decoder.cpp",
    "prefill_attention.cpp",
    "delta_rule.cpp",
)
_HEADER_NAMES = (
    "qgemm.h",
    "decoder.h",
    "vec.h",
    "prefill_attention.h",
    "prefill_attention_body.inc",
    "delta_rule.h",
    "delta_rule_body.inc",
)
SOURCES = [CSRC / name for name in _SOURCE_NAMES]
HEADERS = [CSRC / name for name in _HEADER_NAMES]
CACHE_ROOT = Path(os.environ.get("DENSA_EXTENSIONS_DIR", "~/.cache/densa/extensions")).expanduser()
ISAS = ("avx512_vnni", "avx2")


def _build_key() -> str:
    # The sources' folder is part of the key: torch's build files name the sources by path, so
    # two checkouts sharing one build folder would each find it stale and rebuild it in turn.
    digest = hashlib.sha256(torch.__version__.encode() + str(CSRC.resolve()).encode())
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, building it on first use; None if it cannot be built here."""
    from torch.utils import cpp_extension

    build_dir = CACHE_ROOT / f"cpu-kernels-{_build_key()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            return cpp_extension.load(
                name="densa_cpu_kernels",
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3", "-fopenmp", "-std=c++17"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, failed build
        logger.warning("densa's C++ CPU kernels are unavailable (%s); using torch ops", exc)
        return None


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Serialize builds with a lock the kernel releases when its holder dies.

    torch's own lock is a file it deletes when done: a process killed mid-build (a test's
    timeout, Ctrl-C) leaves it behind, and every later engine then waits on it forever (seen:
    engines that never started, `uvicorn did not start` after 300 s). Whoever holds this flock is
    the only process that can be building, so a torch lock file found under it is stale."""
    with open(build_dir / "densa.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_available() -> bool:
    return load() is not None and bool(isa())


@functools.cache
def isa() -> str:
    """The code path kernels take: DENSA_CPU_ISA if set, else the best this CPU runs ('' if
    none)."""
    module = load()
    if module is None:
        return ""
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {', '.join(ISAS)}")
        return forced
    return str(module.best_isa())


@functools.cache
def fp8_table() -> torch.Tensor:
    """float32 value of each e4m3fn code: the extension's scalar tails (prefill attention, the
    fused decode step, widen_kv) widen fp8 through it."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


if __name__ == "__main__":  # scripts/setup.sh: build ahead of time so serving starts at once
    ext = load()
    print(f"densa C++ kernels: {'built' if ext else 'unavailable'}; path: {isa() or '-'}")
    sys.exit(0 if ext is not None else 1)
