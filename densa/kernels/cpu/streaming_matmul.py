"""The Numba streaming matmuls behind cpu_linear (fp32 weights), fp8_linear and grouped_linear:
each walks the weight rows once, in parallel tasks of _ROWS_PER_TASK rows, and dots each row
(still in L1) with the activation rows in the same order whatever their number (batch
invariance: docs/architecture.md). Why each exists and when it runs: those modules' docstrings.

A module of its own, imported by those modules on their first streamed call, so that importing
the model code does not import Numba (~55 MiB resident): a GGUF model's layers and head run in
C++ (qgemm, the fused decoder) and never reach these.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from densa.kernels.cpu import numba_threads  # noqa: F401  (must run before any parallel kernel)

_ROWS_PER_TASK = 16  # weight rows per parallel task: big enough to amortize scheduling
_TOKEN_BLOCK = 16  # activation rows a task's weight rows pass at a time
# The e4m3 fields placed at the top of an fp32 bit pattern give value * 2**-120 (subnormals
# included: both formats' subnormals scale the same way); the factor goes into the block scale.
_FP32_BITS_SCALE = np.float32(2.0**120)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def streaming_matmul(weight: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    num_out, num_in = weight.shape
    num_rows = x.shape[0]
    num_tasks = (num_out + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(num_tasks):
        for t0 in range(0, num_rows, _TOKEN_BLOCK):
            for r in range(task * _ROWS_PER_TASK, min(num_out, (task + 1) * _ROWS_PER_TASK)):
                for i in range(t0, min(num_rows, t0 + _TOKEN_BLOCK)):
                    # The one loop every output runs: same order for any M and any block.
                    acc = np.float32(0.0)
                    for j in range(num_in):
                        acc += weight[r, j] * x[i, j]
                    out[i, r] = acc


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def streaming_fp8_matmul(
    weight: np.ndarray, scale: np.ndarray, block: int, x: np.ndarray, out: np.ndarray
) -> None:
    num_out, num_in = weight.shape
    num_rows = x.shape[0]
    num_tasks = (num_out + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(num_tasks):
        first = task * _ROWS_PER_TASK
        count = min(num_out, first + _ROWS_PER_TASK) - first
        # The task's weight rows, widened and scaled once, then reused from L1/L2 by every token.
        bits = np.empty((count, num_in), dtype=np.uint32)
        rows = bits.view(np.float32)
        for r in range(count):
            for j in range(num_in):
                byte = np.uint32(weight[first + r, j])
                bits[r, j] = ((byte & 0x80) << 24) | ((byte & 0x7F) << 20)
            for b in range(scale.shape[1]):
                factor = scale[first + r, b] * _FP32_BITS_SCALE
                for j in range(b * block, min(num_in, (b + 1) * block)):
                    rows[r, j] *= factor
        for t0 in range(0, num_rows, _TOKEN_BLOCK):
            for r in range(count):
                for i in range(t0, min(num_rows, t0 + _TOKEN_BLOCK)):
                    # The one loop every output runs: same order for any M (batch invariance).
                    acc = np.float32(0.0)
                    for j in range(num_in):
                        acc += rows[r, j] * x[i, j]
                    out[i, first + r] = acc


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def grouped_streaming_matmul(weight, x, experts, bounds, out):
    """out[rows of segment s] = x[rows] @ weight[experts[s]]^T, tasks = (segment, row block)."""
    num_out, num_in = weight.shape[1], weight.shape[2]
    blocks = (num_out + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(len(experts) * blocks):
        s, block = task // blocks, task % blocks
        e = experts[s]
        for r in range(block * _ROWS_PER_TASK, min(num_out, (block + 1) * _ROWS_PER_TASK)):
            for i in range(bounds[s], bounds[s + 1]):
                acc = np.float32(0.0)
                for j in range(num_in):
                    acc += weight[e, r, j] * x[i, j]
                out[i, r] = acc
