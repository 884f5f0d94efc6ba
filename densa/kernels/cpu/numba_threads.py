"""Choose Numba's threading layer once, before any parallel kernel runs (importing this does it)."""

from __future__ import annotations

import os
from typing import Any

import numba


def configure() -> None:
    """Prefer Numba's OpenMP threading layer unless the environment already chose one.

    Measured on 2 cores next to torch (whose ATen backend is its own bundled libgomp):
    - "omp": Numba's pool runs on the system libgomp, a second OpenMP runtime beside torch's,
      each with one worker thread besides the caller. A parallel region launches in ~2 us.
      Alternating torch matmuls and these kernels in one process works (no crash), and the
      extra time of the alternation did not change with GOMP_SPINCOUNT=0..1e5 or
      OMP_WAIT_POLICY=passive, i.e. it is cache eviction, not the two pools' spinning workers
      oversubscribing the cores. Passive waiting only added ~90 us of wake-up per call.
    - "workqueue" (Numba's own sleeping pool): ~70 us per parallel region, more than a whole
      short decode kernel. "tbb" is not installed.
    Like any spin-waiting OpenMP runtime (torch's included), "omp" degrades badly when other
    busy processes share the cores: a barrier then waits whole scheduler ticks (4-16 ms).
    """
    if "NUMBA_THREADING_LAYER" not in os.environ:
        config: Any = numba.config  # its attributes are set dynamically; mypy cannot see them
        config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


configure()
